"""The BlockLedger's optimistic-concurrency transaction on ML Metadata.

ML Metadata has no multi-call transactions, and read-modify-write of a property loses updates.
Every ledger change is therefore a single `put_execution` call, which MLMD commits
atomically, and which creates a record with a *unique name* for every state it replaces: the next
`BlockVersion` of each block it charges (and the next `LedgerVersion` for changes of the ledger
state). Two writers that read the same version both try to create the same name; MLMD rejects the
second call as a whole (AlreadyExistsError, rolled back), and the loser re-reads and re-checks.
This is optimistic concurrency control with the name as compare-and-swap: no lost update, and a
process killed at any point leaves each grant whole or absent.

On MySQL a writer may also lose its connection mid-call (the server restarted): the store
reconnects and raises CommitUnknown, since the call may have committed. Each writer passes
`retrying` a `committed` check that reads the ledger for what the lost call would have written
(a grant: its execution, uniquely named `grant-<id>`, with the id kept across attempts); only if
it is absent does the attempt run again. So a grant is never charged twice: the second commit of
the same `grant-<id>` would be refused by the unique name in any case.

On MySQL a grant runs in a transaction of its own instead (`session`, mysql_commit.py): the
same rows, its blocks read locked, 2 round trips in all where ML Metadata's calls send about
25 per block. The version names still act as above against writers using MLMD's calls.
"""
from __future__ import annotations

import contextlib
import random
import time
from typing import Callable, Iterator, Mapping, Optional, Sequence, TypeVar

from ml_metadata import errors as mlmd_errors
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access.errors import LedgerBusy
from sage_tfx.sage_access.records import (BLOCK_VERSION_TYPE, LEDGER_VERSION_TYPE, LedgerRecords,
                                          get_property, output_event, set_properties)
from sage_tfx.sage_access.mysql_commit import MySQLCommits, Transaction
from sage_tfx.sage_access.store import CommitUnknown, ReconnectingMySQLStore, is_lock_error

_MAX_ATTEMPTS = 400
_MAX_WAIT_SECONDS = 60.0

T = TypeVar("T")


class Conflict(Exception):
    """Another writer committed first (a unique name exists already); re-read and retry."""


class Transactions:
    """Commits of one ledger context: each one MLMD call, retried on conflict."""

    def __init__(self, records: LedgerRecords):
        self._records = records
        # Attempts re-run because a concurrent writer won (Conflict, or a lock wait or deadlock
        # the store rolled back): what overlapping writers cost each other (benchmarks).
        self.retries = 0
        # On MySQL, changes that name the artifacts they update as read go through
        # mysql_commit: the same rows in one transaction of a few statements.
        store = records.store
        self._mysql = (MySQLCommits(store.spec) if isinstance(store, ReconnectingMySQLStore)
                       and not store.read_only else None)

    @contextlib.contextmanager
    def session(self) -> Iterator[Optional[Transaction]]:
        """Where a change reads and commits. On MySQL, one transaction (mysql_commit.py): what
        it reads by external id stays locked until the change commits at the end of the block,
        and `commit(..., session=...)` writes in it. Elsewhere None: each read and the commit
        are MLMD calls of their own (the commit's unique version names are the compare-and-
        swap). Conflict if the transaction lost to another writer (nothing written)."""
        if self._mysql is None or not self._mysql.available():
            yield None
            return
        try:
            with self._mysql.transaction() as transaction:
                yield transaction
        except (mlmd_errors.AlreadyExistsError, mlmd_errors.AbortedError) as error:
            raise Conflict(str(error)) from None

    def commit(self, kind: str, execution_props: dict,
               artifact_and_events: list[tuple[pb.Artifact, pb.Event]],
               extra_contexts: Sequence[pb.Context] = (), name: Optional[str] = None,
               read: Optional[Mapping[int, pb.Artifact]] = None,
               session: Optional[Transaction] = None) -> int:
        """Write an execution of type `kind` with its records in one MLMD call; Conflict if a
        record's unique name (a version, a share use, the execution's name) exists already.
        In a MySQL `session`, the same rows in that transaction's few statements; `read` (the
        artifacts the change updates, by id, as read) is what they are updated from, and a
        version moved since is a Conflict."""
        records = self._records
        execution = pb.Execution(type_id=records.types[kind],
                                 last_known_state=pb.Execution.COMPLETE, name=name)
        set_properties(execution, dict(execution_props, ledger=records.context))
        contexts = [records.context_node, *extra_contexts]
        try:
            if session is not None:
                return session.put_execution(execution, artifact_and_events, contexts, read,
                                             version_key="version")
            execution_id, _, _ = records.store.put_execution(
                execution, artifact_and_events, contexts, reuse_context_if_already_exist=True)
        except (mlmd_errors.AlreadyExistsError, mlmd_errors.AbortedError) as error:
            raise Conflict(str(error)) from None
        return execution_id

    def retrying(self, attempt: Callable[[], T], committed: Callable[[], Optional[T]]) -> T:
        """Run read-check-commit until it commits without a conflicting writer. After a commit
        of unknown fate (CommitUnknown), `committed()` runs before every further attempt: what
        the lost call committed (its result), read from the ledger, or None if it did not."""
        deadline = time.monotonic() + _MAX_WAIT_SECONDS
        fate_unknown = False
        for tries in range(_MAX_ATTEMPTS):
            try:
                if fate_unknown:
                    landed = committed()
                    if landed is not None:
                        return landed
                return attempt()
            except CommitUnknown:
                fate_unknown = True
                continue  # the store has reconnected: resolve at once
            except Conflict:
                pass
            except mlmd_errors.StatusError as error:
                if not is_lock_error(error):
                    raise
            self.retries += 1
            if time.monotonic() > deadline:
                break
            time.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** min(tries, 6))))
        raise LedgerBusy(f"ledger {self._records.context!r}: gave up after repeated conflicts "
                         "with concurrent writers; nothing was charged")

    def block_version(self, block: str, version: int) -> pb.Artifact:
        """The unique-named record of a block's next version: the compare-and-swap token.

        Deliberately without properties (each costs a row per write on the grant path); what
        changed is on the execution that created it (a Grant's blocks and demand, or an update's
        kind), linked by an OUTPUT event.
        """
        records = self._records
        return pb.Artifact(type_id=records.types[BLOCK_VERSION_TYPE],
                           name=records.version_name(block, version),
                           external_id=records.version_external_id(block, version))

    def ledger_version(self, state: pb.Artifact, kind: str, **changes) -> list:
        """The updated LedgerState plus its unique version record (the compare-and-swap)."""
        records = self._records
        version = get_property(state, "version") + 1
        updated = pb.Artifact()
        updated.CopyFrom(state)
        set_properties(updated, dict(changes, version=version))
        record = pb.Artifact(type_id=records.types[LEDGER_VERSION_TYPE],
                             name=f"{records.context}/ledger/v{version}")
        set_properties(record, {"ledger": records.context, "kind": kind, "version": version})
        return [(updated, output_event()), (record, output_event())]
