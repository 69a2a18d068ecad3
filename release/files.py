"""Released tables as files that carry their guarantee: a CSV with a JSON sidecar
(`FILE.csv.guarantee.json`, Guarantee.to_json) and Parquet with the same JSON in its schema
metadata (key `sage_tfx.guarantee`). Written to a temporary name and renamed, so a reader never
sees half a release."""
from __future__ import annotations

import json
import os

from sage_tfx.release.guarantee import Guarantee

PARQUET_GUARANTEE_KEY = b"sage_tfx.guarantee"


def _replace_atomically(path: str, write) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def guarantee_sidecar(path: str) -> str:
    """Where the guarantee of the file at `path` is written beside it."""
    return f"{path}.guarantee.json"


def write_json(path: str, values: dict) -> None:
    """`values` as one JSON line at `path`, atomically."""
    def write(temporary: str) -> None:
        with open(temporary, "w") as out:
            out.write(json.dumps(values) + "\n")
    _replace_atomically(path, write)


def write_csv(table, path: str, guarantee: Guarantee) -> None:
    """`table` as CSV at `path` and its guarantee in `guarantee_sidecar(path)`."""
    _replace_atomically(path, lambda temporary: table.to_csv(temporary, index=False))
    write_json(guarantee_sidecar(path), guarantee.to_json())


def write_parquet(table, path: str, guarantee: Guarantee) -> None:
    """`table` as Parquet at `path`, its guarantee in the schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = pa.Table.from_pandas(table, preserve_index=False)
    arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}),
                                           PARQUET_GUARANTEE_KEY: json.dumps(
                                               guarantee.to_json()).encode()})
    _replace_atomically(path, lambda temporary: pq.write_table(arrow, temporary))
