"""Tables of the DP statistics: ledger blocks with their rows, under a name, with the privacy unit.

`sage-tfx ingest` (ingest.py) registers a table once and then its blocks. The table's record is
an ML Metadata artifact `sage_tfx.Table` named `<context>/table/<name>` in the ledger's store,
holding its definition as JSON: the unit column (so a query's unit comes from ingest, never from
the query), the columns and their types, and how rows are cut into blocks:

* by time (`month`, `day`, `hour` of a time column): a unit's rows spread over many blocks, so a
  release is DP for the unit *within the blocks read*;
* by a keyed hash of the unit into K blocks (`user_hash`; the key is a secret of the table,
  kept beside its rows, never in this record: ingest.USER_HASH_KEY_FILE): all rows of a unit
  lie in one block of the table, so a release is DP for the unit, and the ledger's per-block
  ceilings bound each unit's total loss *through this table's blocks* (Sage §4.4, user-level
  accounting).

The bound is per table. A person who appears in several tables (or in the same data ingested
again under another name, with or without --user-blocks) has rows in blocks of each, and each
table's blocks have their own ceilings: that person's loss is the sum over the tables. A JOIN
requires the tables' unit columns to have the same *name*; that they mean the same people (the
same id space) is the ingesting user's promise, which no check can verify. Joined tables whose
same-named unit columns hold different people's ids would pair rows of different people.

Blocks made by BlockExampleGen (TFX) have no table record: with block_by="users" it writes, beside
each block's Examples, `block_key.json` naming the column the blocks were cut by (every row of
one value of it lies in one block). `guarantee_unit_of_blocks` reads these records, never the
reader's say-so, to state the unit of a release.

Each block is the ledger block `<table>.<part>` (e.g. `trips.2013-01`, `trips.users-003-of-016`)
whose data_uri is a directory holding `rows.parquet`. The definition holds nothing computed from
the rows (issue 16: no count leaves without DP).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from ml_metadata import errors as mlmd_errors
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.dp_statistics.aggregation.spec import GuaranteeUnit
from sage_tfx.dp_statistics.aggregation.sql import ARROW_TYPES
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.ledger import BlockLedger

TABLE_TYPE = "sage_tfx.Table"
ROWS_FILE = "rows.parquet"
BLOCK_KEY_FILE = "block_key.json"
USER_HASH = "user_hash"
_TABLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class Table:
    """A table's definition as ingest recorded it."""
    name: str
    unit_column: str
    columns: Mapping[str, str]  # name -> a kind of sql.ARROW_TYPES, in CSV order
    partition: str  # "month" | "day" | "hour" | "user_hash"
    time_column: Optional[str] = None
    user_blocks: Optional[int] = None

    @property
    def guarantee_unit(self) -> GuaranteeUnit:
        return GuaranteeUnit.UNIT if self.partition == USER_HASH \
            else GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([(name, ARROW_TYPES[kind]) for name, kind in self.columns.items()])

    def block_id(self, part: str) -> str:
        return f"{self.name}.{part}"

    def owns(self, block_id: str) -> bool:
        return block_id.startswith(self.name + ".")

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"columns": dict(self.columns)}, sort_keys=True)


def check_table_name(name: str) -> str:
    if not isinstance(name, str) or not _TABLE_NAME.match(name):
        raise BadRequest(f"table name {name!r} must be a letter then up to 63 letters, digits "
                         "or _ (it names the table in SQL and prefixes its block ids)")
    return name


def _record_name(context: str, table: str) -> str:
    return f"{context}/table/{table}"


def register_table(ledger: BlockLedger, table: Table) -> None:
    """Record `table` in the ledger's store; an existing table of that name must have the same
    definition (a later ingest adds blocks to it), else BadRequest."""
    check_table_name(table.name)
    store = ledger.store
    type_id = store.put_artifact_type(pb.ArtifactType(name=TABLE_TYPE))
    existing = find_table(ledger, table.name, missing_ok=True)
    if existing is None:
        record = pb.Artifact(type_id=type_id, name=_record_name(ledger.context, table.name))
        record.custom_properties["ledger"].string_value = ledger.context
        record.custom_properties["definition"].string_value = table.to_json()
        try:
            store.put_artifacts([record])
            return
        except mlmd_errors.AlreadyExistsError:  # a concurrent ingest registered it first
            existing = find_table(ledger, table.name)
    if existing != table:
        raise BadRequest(f"table {table.name!r} exists in ledger {ledger.context!r} with another "
                         f"definition ({existing.to_json()}); ingest under a new --table name")


def find_table(ledger: BlockLedger, name: str, missing_ok: bool = False) -> Optional[Table]:
    try:
        record = ledger.store.get_artifact_by_type_and_name(TABLE_TYPE,
                                                            _record_name(ledger.context, name))
    except mlmd_errors.NotFoundError:  # the type itself is unknown: no table was ever ingested
        record = None
    if record is None:
        if missing_ok:
            return None
        raise BadRequest(f"no table {name!r} in ledger {ledger.context!r}; ingest it first "
                         "(sage-tfx ingest)")
    definition = json.loads(record.custom_properties["definition"].string_value)
    return Table(**definition)


def read_blocks(ledger: BlockLedger, table: Table, block_ids: Sequence[str]) -> pa.Table:
    """The rows of `table` in the given blocks (of a grant), in the table's schema."""
    owned = [block_id for block_id in block_ids if table.owns(block_id)]
    parts = [pq.read_table(os.path.join(block.data_uri, ROWS_FILE), schema=table.schema)
             for block in ledger.blocks(owned)]
    return pa.concat_tables(parts) if parts else table.schema.empty_table()


def record_block_key(data_uri: str, unit_column: str) -> None:
    """Record, beside a block's data, that the blocks were cut by `unit_column`: all rows of
    one value of it lie in this one block (BlockExampleGen with block_by="users")."""
    import tensorflow as tf  # gfile: the block's data_uri may be any TFX filesystem

    with tf.io.gfile.GFile(os.path.join(data_uri, BLOCK_KEY_FILE), "w") as handle:
        json.dump({"unit_column": unit_column}, handle)


def tables_of(ledger: BlockLedger, block_ids: Sequence[str]) -> dict[str, Optional[Table]]:
    """The ingested table whose block each of `block_ids` is, by the tables' records (each read
    once); None for any other block (BlockExampleGen's)."""
    names = {block_id.split(".", 1)[0] for block_id in block_ids if "." in block_id}
    found = {name: find_table(ledger, name, missing_ok=True) for name in names}
    owners = {}
    for block_id in block_ids:
        table = found.get(block_id.split(".", 1)[0]) if "." in block_id else None
        owners[block_id] = table if table is not None and table.owns(block_id) else None
    return owners


def _keyed_by(data_uri: Optional[str], unit_column: str) -> bool:
    """Whether BlockExampleGen recorded, beside the block's data, that it cut by `unit_column`."""
    import tensorflow as tf

    path = os.path.join(data_uri, BLOCK_KEY_FILE) if data_uri else None
    if path is None or not tf.io.gfile.exists(path):
        return False
    with tf.io.gfile.GFile(path) as handle:
        return json.load(handle).get("unit_column") == unit_column


def guarantee_unit_of_blocks(ledger: BlockLedger, block_ids: Sequence[str],
                             unit_column: str) -> GuaranteeUnit:
    """The unit of a release computed from rows of `block_ids` with privacy unit `unit_column`:
    the unit itself when every block was cut by that column (its table record, or the block
    key BlockExampleGen recorded, says so), so each unit's rows lie in one block and the
    blocks' ceilings bound its loss; else the weaker unit *within the blocks read*."""
    if not block_ids:
        return GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ
    owners = tables_of(ledger, block_ids)
    others = [block_id for block_id, table in owners.items() if table is None]
    data_uris = {block.block_id: block.data_uri for block in ledger.blocks(others)}
    if all(table.partition == USER_HASH and table.unit_column == unit_column
           if table is not None else _keyed_by(data_uris[block_id], unit_column)
           for block_id, table in owners.items()):
        return GuaranteeUnit.UNIT
    return GuaranteeUnit.UNIT_WITHIN_BLOCKS_READ
