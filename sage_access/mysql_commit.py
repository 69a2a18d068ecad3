"""A ledger change on ML Metadata's MySQL schema in one transaction of a few statements.

ML Metadata stays the store of record: the rows written here are the rows MLMD's own
`put_execution` writes (the same tables, columns and values, in MLMD's schema version
`SCHEMA_VERSION`, checked when connecting; tests/sage_access/test_mysql_commit.py compares the
two row by row), so every MLMD client reads them as its own, and the ledger reads them back
through MLMD. Only how they are sent differs. MLMD's client sends one statement per row and
per check, each a round trip to the server: per artifact it reads the type and the stored
artifact back, rewrites each changed property as a DELETE and an INSERT, then asks for
last_insert_id; about 25 statements per block a grant charges. Here one grant is one
transaction of about ten statements whatever the number of blocks: each table's rows go in one
multi-row statement.

Concurrency. The artifacts a change updates (a grant's blocks) are first locked (`SELECT ...
FOR UPDATE` on their version property, in id order, so two writers never wait on each other in
a cycle) and their version compared with the version the change was computed from; if one
moved, the change is rolled back and raises AbortedError, which the ledger treats as a conflict
(re-read and retry, transaction.py). The unique names (BlockVersion `<block>/v<n>`, `grant-<id>`)
still refuse a second writer of the same version, as with MLMD's own calls (AlreadyExistsError),
so writers using either path exclude each other. InnoDB deadlock victims and lock-wait timeouts
are rolled back whole and raise AbortedError too.

Crashes. A transaction is all or nothing in InnoDB: a client killed mid-change leaves nothing
(the server rolls back its connection's transaction); a lost connection raises CommitUnknown,
and the caller resolves the change's fate from the ledger (transaction.Transactions.retrying).
"""
from __future__ import annotations

import time
from typing import Mapping, Optional, Sequence

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
    old = {key: _value(value) for key, value in before.custom_properties.items()}
    new = {key: _value(value) for key, value in node.custom_properties.items()}
    return ([(key, value) for key, value in sorted(new.items()) if old.get(key) != value],
            sorted(set(old) - set(new)))


class MySQLCommits:
    """Ledger changes written straight into ML Metadata's tables on MySQL, one transaction each
    (see the module's docstring). `available()` is False when the database's MLMD schema is not
    the version this module writes: the ledger then uses MLMD's own calls."""

    def __init__(self, spec: MySQLStore):
        self.spec = spec
        self._connection = None
        self._schema_matches: Optional[bool] = None

    def _connect(self):
        if self._connection is None:
            self._connection = until_reachable(lambda: self.spec.pymysql_connection(
                database=self.spec.database, autocommit=False))
        return self._connection

    def available(self) -> bool:
        if self._schema_matches is None:
            with self._connect().cursor() as cursor:
                cursor.execute("SELECT MAX(`schema_version`) FROM `MLMDEnv`")
                self._schema_matches = cursor.fetchone()[0] == SCHEMA_VERSION
            self._connection.commit()
        return self._schema_matches

    def put_execution(self, execution: pb.Execution,
                      artifact_and_events: Sequence[tuple[pb.Artifact, pb.Event]],
                      contexts: Sequence[pb.Context], read: Mapping[int, pb.Artifact],
                      version_key: str) -> int:
        """What MLMD's `put_execution(execution, artifact_and_events, contexts,
        reuse_context_if_already_exist=True)` writes, in one transaction; the new execution's
        id. Artifacts with an id are updates of `read[id]` (the artifact as read, whose custom
        property `version_key` each update moves: locked and compared first); artifacts without
        one are created. AlreadyExistsError if a unique name is taken, AbortedError if an
        updated artifact's version moved since it was read (or InnoDB rolled the transaction
        back), CommitUnknown if the connection was lost: nothing is written in the first two."""
        import pymysql

        connection = self._connect()
        try:
            with connection.cursor() as cursor:
                execution_id = self._write(cursor, execution, artifact_and_events, contexts,
                                           read, version_key)
            connection.commit()
            return execution_id
        except (pymysql.err.InterfaceError, ConnectionError) as error:
            self._lost(error)
        except pymysql.MySQLError as error:
            if connection_lost(error):
                self._lost(error)
            code = error.args[0] if error.args else None
            connection.rollback()
            if code == _DUPLICATE_KEY:
                raise mlmd_errors.AlreadyExistsError(f"mysql_commit: {error.args[-1]}") from None
            if code in _ROLLED_BACK:
                raise mlmd_errors.AbortedError(f"mysql_commit: {error.args[-1]}") from None
            raise
        except _Moved as moved:
            connection.rollback()
            raise mlmd_errors.AbortedError(str(moved)) from None
        except BaseException:  # nothing half-written stays in the transaction
            connection.rollback()
            raise

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

    @staticmethod
    def _write(cursor, execution, artifact_and_events, contexts, read, version_key) -> int:
        now = _now_ms()
        updated = [a for a, _ in artifact_and_events if a.HasField("id")]
        created = [a for a, _ in artifact_and_events if not a.HasField("id")]
        if updated:
            # Lock the updated artifacts' versions (in id order), then compare.
            ids = sorted(a.id for a in updated)
            cursor.execute(
                "SELECT `artifact_id`, `int_value` FROM `ArtifactProperty` WHERE `artifact_id` "
                f"IN ({', '.join(['%s'] * len(ids))}) AND `name` = %s AND "
                "`is_custom_property` = 1 ORDER BY `artifact_id` FOR UPDATE",
                (*ids, version_key))
            stored = dict(cursor.fetchall())
            for artifact_id in ids:
                expected = read[artifact_id].custom_properties[version_key].int_value
                if stored.get(artifact_id) != expected:
                    raise _Moved(f"artifact {artifact_id} moved past version {expected}")
        cursor.execute(
            "INSERT INTO `Execution` (`type_id`, `last_known_state`, `name`, `external_id`, "
            "`create_time_since_epoch`, `last_update_time_since_epoch`) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            (execution.type_id, execution.last_known_state if execution.HasField(
                "last_known_state") else None, execution.name or None,
             execution.external_id or None, now, now))
        execution_id = cursor.lastrowid
        context_ids = [_context_id(cursor, context, now) for context in contexts]
        execution_properties, _ = _changed_properties(execution, pb.Execution())
        if execution_properties:
            cursor.executemany(
                "INSERT INTO `ExecutionProperty` (`execution_id`, `name`, `is_custom_property`, "
                f"{_VALUE_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)",
                [(execution_id, key, 1, *value) for key, value in execution_properties])
        if context_ids:
            cursor.executemany("INSERT INTO `Association` (`context_id`, `execution_id`) "
                               "VALUES (%s, %s)",
                               [(context_id, execution_id) for context_id in context_ids])
        ids = {id(a): a.id for a in updated}
        if created:
            for artifact in created:
                if artifact.properties:
                    raise ValueError("mysql_commit writes custom properties only")
            cursor.executemany(
                "INSERT INTO `Artifact` (`type_id`, `uri`, `state`, `name`, `external_id`, "
                "`create_time_since_epoch`, `last_update_time_since_epoch`) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [(a.type_id, a.uri, a.state if a.HasField("state") else None, a.name or None,
                  a.external_id or None, now, now) for a in created])
            # Their ids, by their unique (type, name): ids of a multi-row insert are consecutive
            # only under some auto-increment lock modes.
            cursor.execute(
                "SELECT `id`, `type_id`, `name` FROM `Artifact` WHERE `type_id` IN "
                f"({', '.join(['%s'] * len({a.type_id for a in created}))}) AND `name` IN "
                f"({', '.join(['%s'] * len(created))})",
                (*sorted({a.type_id for a in created}), *[a.name for a in created]))
            by_name = {(type_id, name): artifact_id for artifact_id, type_id, name in cursor}
            for artifact in created:
                ids[id(artifact)] = by_name[(artifact.type_id, artifact.name)]
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
        if changed:
            # Each property row is replaced whole (a property may change its kind).
            cursor.executemany(
                "INSERT INTO `ArtifactProperty` (`artifact_id`, `name`, `is_custom_property`, "
                f"{_VALUE_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s) ON DUPLICATE KEY UPDATE "
                "`int_value` = VALUES(`int_value`), `double_value` = VALUES(`double_value`), "
                "`string_value` = VALUES(`string_value`), `byte_value` = NULL, "
                "`proto_value` = NULL, `bool_value` = NULL", changed)
        if removed:
            cursor.executemany("DELETE FROM `ArtifactProperty` WHERE `artifact_id` = %s AND "
                               "`name` = %s AND `is_custom_property` = 1", removed)
        if updated:
            cursor.execute(
                "UPDATE `Artifact` SET `last_update_time_since_epoch` = %s WHERE `id` IN "
                f"({', '.join(['%s'] * len(updated))})", (now, *[a.id for a in updated]))
        for _, event in artifact_and_events:
            if event.path.steps or event.HasField("artifact_id") or event.HasField(
                    "execution_id"):
                raise ValueError("mysql_commit writes events without paths or ids")
        cursor.executemany(
            "INSERT INTO `Event` (`artifact_id`, `execution_id`, `type`, "
            "`milliseconds_since_epoch`) VALUES (%s, %s, %s, %s)",
            [(ids[id(artifact)], execution_id, event.type, now)
             for artifact, event in artifact_and_events])
        if context_ids:
            # An artifact already attributed to a context (a block, to its ledger) keeps its row.
            cursor.executemany(
                "INSERT INTO `Attribution` (`context_id`, `artifact_id`) VALUES (%s, %s) "
                "ON DUPLICATE KEY UPDATE `context_id` = `context_id`",
                [(context_id, ids[id(artifact)]) for context_id in context_ids
                 for artifact, _ in artifact_and_events])
        return execution_id


class _Moved(Exception):
    """An artifact to update is no longer at the version it was read at."""


def _context_id(cursor, context: pb.Context, now: int) -> int:
    """The id of `context`, created (without properties) if it has none and its (type, name)
    does not exist yet: MLMD's `reuse_context_if_already_exist`."""
    if context.HasField("id"):
        return context.id
    if context.properties or context.custom_properties:
        raise ValueError("mysql_commit creates contexts without properties only")
    # LAST_INSERT_ID(id) makes the existing row's id the statement's insert id.
    cursor.execute(
        "INSERT INTO `Context` (`type_id`, `name`, `external_id`, `create_time_since_epoch`, "
        "`last_update_time_since_epoch`) VALUES (%s, %s, %s, %s, %s) "
        "ON DUPLICATE KEY UPDATE `id` = LAST_INSERT_ID(`id`)",
        (context.type_id, context.name, context.external_id or None, now, now))
    return cursor.lastrowid
