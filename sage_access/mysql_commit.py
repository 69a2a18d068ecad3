"""A ledger change on ML Metadata's MySQL schema in one transaction of a few round trips.

ML Metadata stays the store of record: the rows written here are the rows MLMD's own
`put_execution` writes (the same tables, columns and values, text beyond ASCII stored as MLMD's
latin1 client stores it; in MLMD's schema version `SCHEMA_VERSION`, checked when connecting;
tests/sage_access/test_mysql_commit.py compares the two row by row), so every MLMD client reads
them as its own, and the ledger reads them back through MLMD. Only how they are sent differs.
MLMD's client sends one statement per row and per check, each a round trip to the server: per
artifact it reads the type and the stored artifact back, rewrites each changed property as a
DELETE and an INSERT, then asks for last_insert_id; about 25 statements per block a grant
charges. Here a grant on named blocks is one transaction of 2 round trips, its reads included,
whatever the number of blocks: its blocks locked and read, with the records of their versions
(named by the server from the blocks' properties, VersionRecords), the changes that made them
and of those only the properties the balance check reads; then every write and the COMMIT in
one batch, each table's rows in one multi-row statement (the server runs as many statements
for 30 blocks as for 1; tests/sage_access/test_mysql_commit.py counts both). Round trips
matter less for their own time than for the locks: a grant holds its blocks' locks from its
first round trip to its COMMIT, and each round trip inside costs the holder a wake-up on a
busy machine, while other writers of those blocks wait (8 writers on overlapping blocks granted
1.2-1.4x as much with the reads in one round trip as in two, at load 11-13, though the server
spends more CPU on the joined read; docs/measurements.md).

Cost. What a grant costs is mostly CPU, the client's Python and the server's statements, not
the round trips (a fraction of a millisecond each on one machine). So an artifact's properties
are read as one JSON array per artifact (one row, one json.loads, where a row per property of
13 columns through PyMySQL's pure-Python protocol was the largest share of a grant's client
CPU), values are rendered into the batch without PyMySQL's per-value dispatch, and statements
whose number grew with the blocks are one statement each (docs/measurements.md has the figures).

Concurrency. The artifacts a change updates (a grant's blocks) are locked before it writes,
their Artifact rows always, so every two writers of one artifact exclude each other: read
locked in the transaction (`SELECT ... FOR UPDATE`, in external id order, so two writers never
wait on each other in a cycle; then read in a statement of its own, which sees what the
previous holder of a lock committed), or, if they were read elsewhere (a window's blocks, chosen
through MLMD), locked when it writes and their version compared with the version the change was
computed from; if one moved, the change is rolled back and raises AbortedError, which the ledger
treats as a conflict (re-read and retry, transaction.py). A grant that waits for another's lock
therefore re-runs nothing. The unique names (BlockVersion `<block>/v<n>`, `grant-<id>`) still
refuse a second writer of the same version, as with MLMD's own calls (AlreadyExistsError), so
writers using either path exclude each other. InnoDB deadlock victims and lock-wait timeouts are
rolled back whole and raise AbortedError too.

Crashes. A transaction is all or nothing in InnoDB: a client killed mid-change leaves nothing
(the server rolls back its connection's transaction); a lost connection raises CommitUnknown,
and the caller resolves the change's fate from the ledger (transaction.Transactions.retrying).
"""
from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

from ml_metadata import errors as mlmd_errors
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access.store import (CommitUnknown, MySQLStore, connection_lost,
                                        until_reachable)

# ML Metadata 1.17's MySQL schema, the one whose rows this module writes.
SCHEMA_VERSION = 10
# MySQL client and server error numbers: a duplicate unique key; a deadlock victim or a lock
# wait timed out (the statement or transaction was rolled back).
_DUPLICATE_KEY = 1062
_ROLLED_BACK = (1205, 1213)
_VALUE_COLUMNS = "`int_value`, `double_value`, `string_value`"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _value(value: pb.Value) -> tuple:
    """(int_value, double_value, string_value) of a custom property, as MLMD stores it."""
    kind = value.WhichOneof("value")
    if kind == "int_value":
        return value.int_value, None, None
    if kind == "double_value":
        return None, value.double_value, None
    if kind == "string_value":
        return None, None, value.string_value
    raise ValueError(f"a property of kind {kind} is not written by mysql_commit")


def _changed_properties(node, before) -> tuple[list, list]:
    """The custom properties of `node` that differ from `before`'s (an empty node for a new one):
    ([(name, value columns)], [names removed])."""
    if node.properties:
        raise ValueError("mysql_commit writes custom properties only")
    old, new = before.custom_properties, node.custom_properties
    # Compared as protos (in C); only what changed is converted (`key in old` first: indexing
    # a proto map adds the key).
    return ([(key, _value(value)) for key, value in sorted(new.items())
             if key not in old or old[key] != value],
            sorted(set(old) - set(new)))


class MySQLCommits:
    """Ledger changes read and written straight in ML Metadata's tables on MySQL, one
    transaction each (see the module's docstring). `available()` is False when the database's
    MLMD schema is not the version this module writes, or the server lacks the JSON functions
    its reads use: the ledger then uses MLMD's own calls."""

    def __init__(self, spec: MySQLStore):
        self.spec = spec
        self._connection = None
        self._schema_matches: Optional[bool] = None

    def _connect(self):
        if self._connection is None:
            # READ COMMITTED: a plain read in a transaction sees what committed before it (the
            # change that made a block's version, committed before its row lock was granted).
            # MariaDB cuts a JSON_ARRAYAGG (an artifact's properties, _ARTIFACTS) at
            # group_concat_max_len (1 MB by default): lifted to what a packet can carry.
            # Every read here is by a unique key (an IN list of external ids or ids), so the
            # optimizer's index statistics (one row a value) replace its dives into the index
            # for each value (eq_range_index_dive_limit = 1), which cost the server more than
            # the reads (0.4 ms for a grant's 60 version names).
            from pymysql.constants import CLIENT

            self._connection = until_reachable(lambda: self.spec.pymysql_connection(
                database=self.spec.database, autocommit=False,
                client_flag=CLIENT.MULTI_STATEMENTS,
                init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; "
                             "SET SESSION group_concat_max_len = @@max_allowed_packet"))
        return self._connection

    def available(self) -> bool:
        import pymysql

        if self._schema_matches is None:
            connection = self._connect()
            with connection.cursor() as cursor:
                cursor.execute("SELECT MAX(`schema_version`) FROM `MLMDEnv`")
                self._schema_matches = cursor.fetchone()[0] == SCHEMA_VERSION
                try:  # reads need JSON_ARRAYAGG: MySQL 5.7.22 and later, MariaDB 10.5 and later
                    cursor.execute("SELECT JSON_ARRAYAGG(1)")
                except pymysql.MySQLError as error:
                    if connection_lost(error):
                        raise
                    self._schema_matches = False
            connection.rollback()  # it only read
        return self._schema_matches

    @contextlib.contextmanager
    def transaction(self) -> Iterator["Transaction"]:
        """One MySQL transaction, committed when the block ends and rolled back if it raises.
        MySQL's errors come out as ML Metadata's: AlreadyExistsError for a unique name taken,
        AbortedError for a deadlock victim, a lock wait timed out or an updated artifact whose
        version moved (nothing written in all three); CommitUnknown when the connection was
        lost (the COMMIT may have reached the server)."""
        import pymysql

        connection = self._connect()
        try:
            with connection.cursor() as cursor:
                transaction = Transaction(cursor)
                yield transaction
            if not transaction.committed:
                connection.commit()
        except (pymysql.err.InterfaceError, ConnectionError) as error:
            self._lost(error)
        except pymysql.MySQLError as error:
            if connection_lost(error):
                self._lost(error)
            code = error.args[0] if error.args else None
            self._roll_back(connection)
            if code == _DUPLICATE_KEY:
                raise mlmd_errors.AlreadyExistsError(f"mysql_commit: {error.args[-1]}") from None
            if code in _ROLLED_BACK:
                raise mlmd_errors.AbortedError(f"mysql_commit: {error.args[-1]}") from None
            raise
        except BaseException:  # nothing half-written stays in the transaction
            self._roll_back(connection)
            raise

    def _roll_back(self, connection) -> None:
        """Roll back the open transaction. If the connection is lost meanwhile (the server
        died), the server rolls it back in any case: the connection is dropped (the next
        transaction reconnects) and the caller raises what made it roll back (a Conflict is
        retried) rather than the lost connection."""
        import pymysql

        try:
            connection.rollback()
        except (pymysql.err.InterfaceError, ConnectionError, pymysql.MySQLError) as error:
            if isinstance(error, pymysql.MySQLError) and not isinstance(
                    error, pymysql.err.InterfaceError) and not connection_lost(error):
                raise
            try:
                connection.close()
            except Exception:  # already closed by the error
                pass
            self._connection = None

    def _lost(self, error: Exception) -> None:
        """The connection is gone (or in an unknown state): drop it and say the commit's fate is
        unknown (a COMMIT may have reached the server before the connection broke)."""
        try:
            self._connection.close()
        except Exception:  # already closed by the error
            pass
        self._connection = None
        raise CommitUnknown(f"a ledger change on {self.spec} lost its connection ({error}); "
                            "it may or may not have committed") from None


class Transaction:
    """Reads and one write in a MySQL transaction (MySQLCommits.transaction). Its reads have
    ML Metadata's names and answers (`get_artifacts_by_external_ids`, ...), so the ledger's
    code reads through it as through an MLMD store; events are read without their paths (the
    ledger writes none)."""

    def __init__(self, cursor):
        self._cursor = cursor
        # {artifact id: its version property} of the artifacts read locked so far.
        self._locked: dict[int, int] = {}
        # What a locked read with `versions` read beside the artifacts (VersionRecords): the
        # external ids it covered, the creators found, their executions and properties read.
        self._covered: set[str] = set()
        self._creators: dict[str, Optional[int]] = {}
        self._changes: dict[int, pb.Execution] = {}
        self._change_keys: tuple[str, ...] = ()
        self.committed = False  # put_execution commits

    def get_artifacts_by_external_ids(self, external_ids: Sequence[str], lock: bool = False,
                                      versions: Optional["VersionRecords"] = None
                                      ) -> list[pb.Artifact]:
        """MLMD's call of that name (an empty list where MLMD raises NotFoundError). With
        `lock`, the artifacts found are locked until the transaction ends (a grant reads its
        blocks so: no other writer changes them in between; every writer here locks the
        artifact rows it updates before writing them), in external id order (the unique
        index's, which the IN list is read in), so two transactions never wait on each other
        in a cycle; under READ COMMITTED an id not found locks nothing (no gap lock).

        Locked first, then read, in one round trip: a read that is not a locking read sees
        what had committed when its statement began (READ COMMITTED), so a statement that
        waited for a lock would read the properties the lock's holder then changed. With
        `versions`, the same round trip reads the creators of the artifacts' version records
        (VersionRecords), which `get_creations_by_external_ids` then answers without another."""
        if not external_ids:
            return []
        named = f"`external_id` IN ({self._literals(external_ids)})"
        where = f"A.{named}"
        read = _ARTIFACTS.format(where=where, order="A.`external_id`")
        if not lock:
            self._cursor.execute(read)
            return _artifacts(self._cursor.fetchall())
        locking = (f"SELECT A.`id` FROM `Artifact` AS A WHERE {where} "
                   f"ORDER BY A.`external_id` FOR UPDATE;\n{read}")
        if versions is None:
            self._cursor.execute(locking)
        else:
            names = versions.names_sql(f"B.{named}", self._literals)
            self._cursor.execute(f"{locking};\n" + self._creations_sql(
                f"A.`external_id` IN ({names})", versions.properties))
        self._cursor.nextset()
        found = _artifacts(self._cursor.fetchall())
        self._locked.update((artifact.id, artifact.custom_properties["version"].int_value)
                            for artifact in found if "version" in artifact.custom_properties)
        if versions is not None:
            self._cursor.nextset()
            creators, changes = self._read_creations()
            self._covered.update(name for artifact in found
                                 for name in versions.external_ids(artifact))
            self._creators.update(creators)
            self._changes.update(changes)
            self._change_keys = versions.properties
        return found

    def _literals(self, values: Sequence) -> str:
        escape = self._cursor.connection.escape
        return ", ".join(_literal(value, escape) for value in values)

    def get_artifacts_by_id(self, artifact_ids: Sequence[int]) -> list[pb.Artifact]:
        if not artifact_ids:
            return []
        self._cursor.execute(_ARTIFACTS.format(
            where=f"A.`id` IN ({_placeholders(artifact_ids)})", order="A.`id`"),
            tuple(artifact_ids))
        return _artifacts(self._cursor.fetchall())

    def get_executions_by_id(self, execution_ids: Sequence[int]) -> list[pb.Execution]:
        # A row per property, unlike artifacts (_ARTIFACTS): a grant's execution holds long
        # strings (its balances, its request), which JSON costs the server more to escape
        # than the client to read as rows.
        if not execution_ids:
            return []
        self._cursor.execute(
            "SELECT E.`id`, E.`type_id`, E.`last_known_state`, E.`name`, E.`external_id`, "
            "E.`create_time_since_epoch`, E.`last_update_time_since_epoch`, P.`name`, "
            "P.`is_custom_property`, P.`int_value`, P.`double_value`, P.`string_value` "
            "FROM `Execution` AS E LEFT JOIN `ExecutionProperty` AS P "
            "ON P.`execution_id` = E.`id` "
            f"WHERE E.`id` IN ({_placeholders(execution_ids)}) ORDER BY E.`id`",
            tuple(execution_ids))
        found: dict[int, pb.Execution] = {}
        for (execution_id, type_id, state, name, external_id, created, updated,
             key, custom, *value) in self._cursor.fetchall():
            if execution_id not in found:
                found[execution_id] = _node(pb.Execution(
                    id=execution_id, type_id=type_id, create_time_since_epoch=created,
                    last_update_time_since_epoch=updated), last_known_state=state,
                    name=_read_text(name), external_id=_read_text(external_id))
            if key is not None:
                _set_value(found[execution_id], _read_text(key), custom, *value)
        return list(found.values())

    def get_events_by_artifact_ids(self, artifact_ids: Sequence[int]) -> list[pb.Event]:
        if not artifact_ids:
            return []
        self._cursor.execute(
            "SELECT `artifact_id`, `execution_id`, `type`, `milliseconds_since_epoch` FROM "
            f"`Event` WHERE `artifact_id` IN ({_placeholders(artifact_ids)}) ORDER BY `id`",
            tuple(artifact_ids))
        return [pb.Event(artifact_id=artifact_id, execution_id=execution_id, type=kind,
                         milliseconds_since_epoch=time_ms)
                for artifact_id, execution_id, kind, time_ms in self._cursor.fetchall()]

    def get_creations_by_external_ids(self, external_ids: Sequence[str],
                                      keys: Sequence[str]) -> tuple[dict, dict]:
        """({external id: the id of the execution with an OUTPUT event on that artifact (the
        last one if several; None for none)} of the artifacts found with these external ids,
        {execution id: that execution with only its custom properties `keys`}), in one round
        trip: what `get_artifacts_by_external_ids`, `get_events_by_artifact_ids` and
        `get_executions_by_id` answer in three (lineage.check_balances reads the records of the
        blocks' last changes so, and of each change only its `balances` and `kind`: a grant's
        other properties, its request and events, are long strings it does not need). In no
        round trip when a locked read in this transaction read them already (`versions`):
        still current, since every writer of those records holds the locks taken then."""
        if not external_ids:
            return {}, {}
        if set(external_ids) <= self._covered and set(keys) <= set(self._change_keys):
            creators = {name: self._creators[name] for name in external_ids
                        if name in self._creators}
            return creators, {execution_id: self._changes[execution_id]
                              for execution_id in creators.values() if execution_id is not None}
        self._cursor.execute(self._creations_sql(
            f"A.`external_id` IN ({self._literals(external_ids)})", keys))
        return self._read_creations()

    def _creations_sql(self, named: str, keys: Sequence[str]) -> str:
        """The two statements `_read_creations` reads: the creators of the artifacts `named`
        (an SQL condition on `Artifact` AS A), then their executions' custom properties `keys`."""
        creators = (f"`Artifact` AS A {{join}} `Event` AS V ON V.`artifact_id` = A.`id` AND "
                    f"V.`type` = {pb.Event.OUTPUT} WHERE {named}")
        return (f"SELECT A.`external_id`, V.`execution_id` FROM "
                f"{creators.format(join='LEFT JOIN')} ORDER BY V.`id`;\n"
                "SELECT P.`execution_id`, P.`name`, P.`int_value`, P.`double_value`, "
                "P.`string_value` FROM `ExecutionProperty` AS P WHERE P.`execution_id` IN "
                f"(SELECT V.`execution_id` FROM {creators.format(join='JOIN')}) AND "
                f"P.`is_custom_property` = 1 AND P.`name` IN ({self._literals(keys)})")

    def _read_creations(self) -> tuple[dict, dict]:
        """The answer of `get_creations_by_external_ids` from `_creations_sql`'s two results."""
        found = {_read_text(external_id): execution_id
                 for external_id, execution_id in self._cursor.fetchall()}
        self._cursor.nextset()
        changes = {execution_id: pb.Execution(id=execution_id)
                   for execution_id in found.values() if execution_id is not None}
        for execution_id, key, *value in self._cursor.fetchall():
            # Under READ COMMITTED the second statement sees what committed after the first
            # began: a creator it alone found (of artifacts not read locked, a window's blocks)
            # is not part of the answer.
            if execution_id in changes:
                _set_value(changes[execution_id], _read_text(key), 1, *value)
        return found, changes

    def put_execution(self, execution: pb.Execution,
                      artifact_and_events: Sequence[tuple[pb.Artifact, pb.Event]],
                      contexts: Sequence[pb.Context], read: Mapping[int, pb.Artifact],
                      version_key: str) -> int:
        """What MLMD's `put_execution(execution, artifact_and_events, contexts,
        reuse_context_if_already_exist=True)` writes, then COMMIT: the transaction's last act;
        the new execution's id. Artifacts with an id are updates of `read[id]` (the artifact as
        read, whose custom property `version_key` each update moves: an artifact this
        transaction did not read locked is locked now and compared, AbortedError if it moved);
        artifacts without one are created.

        Every row goes in one round trip: the statements are sent together (MySQL's
        multi-statements), the ids the server assigns passed on in session variables, and
        COMMIT last; the server stops at the first statement that fails (a unique name
        taken), leaving the transaction to be rolled back whole."""
        cursor = self._cursor
        now = _now_ms()
        updated = [a for a, _ in artifact_and_events if a.HasField("id")]
        created = [a for a, _ in artifact_and_events if not a.HasField("id")]
        unlocked = sorted(a.id for a in updated if a.id not in self._locked)
        if unlocked:  # locked as a named read locks them: the artifact's row first
            cursor.execute(
                "SELECT A.`id`, P.`int_value` FROM `Artifact` AS A LEFT JOIN `ArtifactProperty` "
                "AS P ON P.`artifact_id` = A.`id` AND P.`name` = %s AND "
                f"P.`is_custom_property` = 1 WHERE A.`id` IN ({_placeholders(unlocked)}) "
                "ORDER BY A.`id` FOR UPDATE", (version_key, *unlocked))
            self._locked.update(cursor.fetchall())
        for artifact in updated:
            expected = read[artifact.id].custom_properties[version_key].int_value
            if self._locked.get(artifact.id) != expected:
                raise mlmd_errors.AbortedError(
                    f"artifact {artifact.id} moved past version {expected}")
        batch = _Batch(cursor.connection)
        batch.add("INSERT INTO `Execution` (`type_id`, `last_known_state`, `name`, "
                  "`external_id`, `create_time_since_epoch`, `last_update_time_since_epoch`) "
                  "VALUES (%s, %s, %s, %s, %s, %s)",
                  execution.type_id, execution.last_known_state if execution.HasField(
                      "last_known_state") else None, execution.name or None,
                  execution.external_id or None, now, now)
        batch.add("SET @sage_execution = LAST_INSERT_ID()")
        context_ids = []
        for index, context in enumerate(contexts):
            if context.HasField("id"):
                context_ids.append(context.id)
                continue
            # MLMD's reuse_context_if_already_exist; LAST_INSERT_ID(id) makes an existing row's
            # id the statement's insert id.
            if context.properties or context.custom_properties:
                raise ValueError("mysql_commit creates contexts without properties only")
            batch.add("INSERT INTO `Context` (`type_id`, `name`, `external_id`, "
                      "`create_time_since_epoch`, `last_update_time_since_epoch`) "
                      "VALUES (%s, %s, %s, %s, %s) "
                      "ON DUPLICATE KEY UPDATE `id` = LAST_INSERT_ID(`id`)",
                      context.type_id, context.name, context.external_id or None, now, now)
            batch.add(f"SET @sage_context{index} = LAST_INSERT_ID()")
            context_ids.append(_Variable(f"@sage_context{index}"))
        execution_properties, _ = _changed_properties(execution, pb.Execution())
        batch.rows("INSERT INTO `ExecutionProperty` (`execution_id`, `name`, "
                   f"`is_custom_property`, {_VALUE_COLUMNS}) VALUES",
                   [(_EXECUTION, key, 1, *value) for key, value in execution_properties])
        batch.rows("INSERT INTO `Association` (`context_id`, `execution_id`) VALUES",
                   [(context_id, _EXECUTION) for context_id in context_ids])
        ids = {id(a): a.id for a in updated}
        for artifact in created:
            if artifact.properties:
                raise ValueError("mysql_commit writes custom properties only")
        batch.rows("INSERT INTO `Artifact` (`type_id`, `uri`, `state`, `name`, `external_id`, "
                   "`create_time_since_epoch`, `last_update_time_since_epoch`) VALUES",
                   [(a.type_id, a.uri, a.state if a.HasField("state") else None,
                     a.name or None, a.external_id or None, now, now) for a in created])
        if created:
            # Ids by the unique (type, name): a multi-row insert's ids are consecutive only
            # under some auto-increment lock modes. One statement for all (one per artifact
            # cost the server a statement's overhead each, 0.1 ms).
            batch.add("SET " + ", ".join(
                f"@sage_artifact{index} = (SELECT `id` FROM `Artifact` WHERE `type_id` = %s "
                "AND `name` = %s)" for index in range(len(created))),
                *[value for artifact in created for value in (artifact.type_id, artifact.name)])
        for index, artifact in enumerate(created):
            ids[id(artifact)] = _Variable(f"@sage_artifact{index}")
        changed, removed = [], []
        for artifact in updated:
            before = read[artifact.id]
            for field in ("type_id", "uri", "state", "name", "external_id"):
                if getattr(artifact, field) != getattr(before, field):
                    raise ValueError(f"mysql_commit updates custom properties only ({field})")
            values, gone = _changed_properties(artifact, before)
            changed += [(artifact.id, key, 1, *value) for key, value in values]
            removed += [(artifact.id, key) for key in gone]
        for artifact in created:
            values, _ = _changed_properties(artifact, pb.Artifact())
            changed += [(ids[id(artifact)], key, 1, *value) for key, value in values]
        # Each property row is replaced whole (a property may change its kind).
        batch.rows("INSERT INTO `ArtifactProperty` (`artifact_id`, `name`, `is_custom_property`, "
                   f"{_VALUE_COLUMNS}) VALUES", changed,
                   "ON DUPLICATE KEY UPDATE `int_value` = VALUES(`int_value`), "
                   "`double_value` = VALUES(`double_value`), "
                   "`string_value` = VALUES(`string_value`), `byte_value` = NULL, "
                   "`proto_value` = NULL, `bool_value` = NULL")
        for artifact_id, key in removed:
            batch.add("DELETE FROM `ArtifactProperty` WHERE `artifact_id` = %s AND `name` = %s "
                      "AND `is_custom_property` = 1", artifact_id, key)
        if updated:
            batch.add("UPDATE `Artifact` SET `last_update_time_since_epoch` = %s WHERE `id` IN "
                      f"({_placeholders(updated)})", now, *[a.id for a in updated])
        for _, event in artifact_and_events:
            if event.path.steps or event.HasField("artifact_id") or event.HasField(
                    "execution_id"):
                raise ValueError("mysql_commit writes events without paths or ids")
        batch.rows("INSERT INTO `Event` (`artifact_id`, `execution_id`, `type`, "
                   "`milliseconds_since_epoch`) VALUES",
                   [(ids[id(artifact)], _EXECUTION, event.type, now)
                    for artifact, event in artifact_and_events])
        # An artifact already attributed to a context (a block, to its ledger) keeps its row.
        batch.rows("INSERT INTO `Attribution` (`context_id`, `artifact_id`) VALUES",
                   [(context_id, ids[id(artifact)]) for context_id in context_ids
                    for artifact, _ in artifact_and_events],
                   "ON DUPLICATE KEY UPDATE `context_id` = `context_id`")
        batch.add("COMMIT")
        execution_id = batch.run(cursor)  # the Execution's, inserted first
        self.committed = True
        return execution_id


@dataclass(frozen=True)
class VersionRecords:
    """The records of an artifact's versions (a block's BlockVersion records), which a locked
    read of the artifacts reads in the same round trip (Transaction.get_artifacts_by_external_ids):
    version v of the artifact whose string custom property `key` is k has the external id
    `{prefix}{k}{infix}{v}`; read are those of v = its int custom property `version` plus each
    of `steps`, their creators (OUTPUT events) and of each creator the custom properties
    `properties`."""
    prefix: str
    key: str
    infix: str
    steps: tuple[int, ...]
    properties: tuple[str, ...]
    version: str = "version"

    def external_ids(self, artifact: pb.Artifact) -> list[str]:
        """The external ids of `artifact`'s version records that `names_sql` names."""
        properties = artifact.custom_properties
        if self.key not in properties or self.version not in properties:
            return []
        return [f"{self.prefix}{properties[self.key].string_value}{self.infix}"
                f"{properties[self.version].int_value + step}" for step in self.steps]

    def names_sql(self, where: str, literals: Callable[[Sequence], str]) -> str:
        """An SQL query of those external ids, of the artifacts (`Artifact` AS B) `where`
        (`literals`: values as SQL literals, Transaction._literals)."""
        steps = " UNION ALL ".join(f"SELECT {int(step)}" + (" AS `step`" if not index else "")
                                   for index, step in enumerate(self.steps))
        return (f"SELECT CONCAT({literals([self.prefix])}, K.`string_value`, "
                f"{literals([self.infix])}, N.`int_value` + S.`step`) FROM `Artifact` AS B "
                "JOIN `ArtifactProperty` AS K ON K.`artifact_id` = B.`id` AND K.`name` = "
                f"{literals([self.key])} AND K.`is_custom_property` = 1 "
                "JOIN `ArtifactProperty` AS N ON N.`artifact_id` = B.`id` AND N.`name` = "
                f"{literals([self.version])} AND N.`is_custom_property` = 1 "
                f"JOIN ({steps}) AS S WHERE {where}")


class _Variable(str):
    """A session variable the batch set (an id the server assigned), written as is."""


_EXECUTION = _Variable("@sage_execution")


class _Batch:
    """Statements sent to the server together (one round trip), their values written in as
    SQL literals (`_literal`). Rendered here rather than by PyMySQL's `execute(query, args)`,
    whose dispatch per value cost a grant's client more than building its rows (about 1,500
    values for 30 blocks)."""

    def __init__(self, connection):
        self._statements: list[str] = []
        # A partial (called in C), not a method calling _literal: one Python call per value.
        self._sql = functools.partial(_literal, escape=connection.escape)

    def add(self, statement: str, *values) -> None:
        """`statement`, its %s placeholders replaced by `values`."""
        self._statements.append(statement % tuple(map(self._sql, values)))

    def rows(self, head: str, rows: Sequence[tuple], tail: str = "") -> None:
        """`head` followed by the rows as a multi-row VALUES list (nothing for no rows)."""
        if not rows:
            return
        sql = self._sql
        self._statements.append(
            f"{head} " + ", ".join("(" + ", ".join(map(sql, row)) + ")" for row in rows)
            + (f" {tail}" if tail else ""))

    def run(self, cursor) -> int:
        """Send the batch; the id its first statement inserted (the server stops at the first
        statement that fails, whose error is raised here)."""
        cursor.execute(";\n".join(self._statements))
        first_id = cursor.lastrowid
        while cursor.nextset():
            pass
        return first_id


# ML Metadata's C++ client talks to MySQL in latin1 (its connection's default character set): it
# sends a string's UTF-8 bytes, which the server takes for latin1 characters and stores as such
# in the utf8mb4 columns, and it reads them back the same way. So that every client reads the
# same text, a string is written here as ML Metadata writes it (its UTF-8 bytes as a latin1
# literal) and read back through the same mapping (tests/sage_access/test_mysql_commit.py
# compares both with ML Metadata's). ASCII, all the ledger's own names, is the same either way.
# MariaDB's and MySQL's latin1 is Windows-1252 with its 5 undefined bytes as the C1 controls of
# the same numbers.
def _latin1_character(byte: int) -> str:
    try:
        return bytes([byte]).decode("cp1252")
    except UnicodeDecodeError:
        return chr(byte)


_LATIN1_BYTES = {ord(_latin1_character(byte)): chr(byte) for byte in range(256)}


def _literal(value, escape) -> str:
    """`value` as an SQL literal: PyMySQL's `escape`, without its dispatch for ints and None, and
    a non-ASCII string as ML Metadata's client sends it."""
    kind = type(value)
    if kind is int:
        return str(value)
    if value is None:
        return "NULL"
    if kind is _Variable:
        return value
    if kind is str and not value.isascii():
        return f"_latin1 X'{value.encode('utf-8').hex()}'"
    return escape(value)  # ASCII strings (in the server's escaping mode), floats, ...


def _read_text(text: Optional[str]) -> Optional[str]:
    """A string column as ML Metadata's client reads it (`_literal`): a value that its bytes
    in latin1 do not decode from UTF-8 (written by some other client) is given as stored."""
    if text is None or text.isascii():
        return text
    try:
        return text.translate(_LATIN1_BYTES).encode("latin-1").decode("utf-8")
    except UnicodeError:
        return text


def _placeholders(values: Sequence) -> str:
    return ", ".join(["%s"] * len(values))


# An artifact's rows as one row: its columns, then its properties as one JSON array of
# [name, is_custom_property, int_value, double_value, string_value] (null for NULL), so a block
# of 15 properties costs the client one row and one json.loads instead of 15 rows of 13 columns
# (the most CPU a grant cost the client; the server spends a little more). JSON carries each
# value as the text protocol does: a double in the server's round-trip form, a string escaped
# and read back whole (tests/sage_access/test_mysql_commit.py compares them with MLMD's reads).
_ARTIFACTS = ("SELECT A.`id`, A.`type_id`, A.`uri`, A.`state`, A.`name`, A.`external_id`, "
              "A.`create_time_since_epoch`, A.`last_update_time_since_epoch`, "
              "(SELECT JSON_ARRAYAGG(JSON_ARRAY(P.`name`, P.`is_custom_property`, "
              "P.`int_value`, P.`double_value`, P.`string_value`)) FROM `ArtifactProperty` AS P "
              "WHERE P.`artifact_id` = A.`id`) FROM `Artifact` AS A "
              "WHERE {where} ORDER BY {order}")


def _artifacts(rows) -> list[pb.Artifact]:
    """The artifacts of _ARTIFACTS's rows."""
    found = []
    for (artifact_id, type_id, uri, state, name, external_id, created, updated,
         properties) in rows:
        artifact = _node(pb.Artifact(id=artifact_id, type_id=type_id,
                                     create_time_since_epoch=created,
                                     last_update_time_since_epoch=updated),
                         uri=_read_text(uri), state=state, name=_read_text(name),
                         external_id=_read_text(external_id))
        for key, custom, *value in json.loads(properties or "[]"):
            _set_value(artifact, _read_text(key), custom, *value)
        found.append(artifact)
    return found


def _node(node, **fields):
    """`node` (an MLMD proto) with those of `fields` that are not NULL set (MLMD leaves the
    others unset)."""
    for key, value in fields.items():
        if value is not None:
            setattr(node, key, value)
    return node


def _set_value(node, key: str, custom: int, int_value, double_value, string_value) -> None:
    """Set property `key` of `node` (an MLMD proto) from its row's value columns."""
    target = (node.custom_properties if custom else node.properties)[key]
    if int_value is not None:
        target.int_value = int_value
    elif double_value is not None:
        target.double_value = double_value
    elif string_value is not None:
        target.string_value = _read_text(string_value)
