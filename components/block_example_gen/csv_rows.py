"""BlockExampleGen's reading of CSV files: each row as a serialized tf.Example, and the check of
the files' headers against the table's public schema. Apart from the executor (no Beam or TFX
here), so that a process that only reads rows loads TensorFlow alone.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional

import pyarrow.compute as pc
import tensorflow as tf

from sage_tfx.dp_statistics.ingest import header_of, text_csv, typed_cells
from sage_tfx.sage_access.errors import BadRequest


# Each column's feature type: its declared type (`columns` as {name: type}), text for a column
# declared without one. Never a cell's: typing each cell by itself ("0" an int64, "0.5" a float)
# gave one record a feature type its neighbours' did not have, and TFX's StatisticsGen failed on
# the Examples ("expected float_list, found int64_list"); typing a column from its cells (TFX's
# CsvExampleGen) lets one odd cell change how every other record is read.
FEATURE_KINDS = {"int": "int64_list", "float": "float_list", "string": "bytes_list"}


def column_types(columns) -> tuple[Optional[list[str]], dict[str, str]]:
    """(the declared column names or None, {name: type}) of the `columns` parameter: a list of
    names, or {name: type} with types of FEATURE_KINDS. ValueError naming what is wrong."""
    if columns is None:
        return None, {}
    names = [str(name) for name in columns]
    types = {str(name): kind for name, kind in columns.items()} if isinstance(
        columns, Mapping) else {}
    unknown = {name: kind for name, kind in types.items() if kind not in FEATURE_KINDS}
    if unknown:
        raise ValueError(f"columns {unknown}: each type must be one of {', '.join(FEATURE_KINDS)}")
    return names, types


def csv_records(path: str, types: Optional[Mapping[str, str]] = None) -> Iterable[bytes]:
    """The rows of one CSV file (its first line names the columns) as serialized tf.Examples,
    each built from its own line only: the lines are read as `sage-tfx ingest` reads them
    (ingest.text_csv: a line that ends inside a quoted cell, is not UTF-8 or has the wrong
    number of cells is dropped by itself). Each cell is stripped and typed by its column's
    type (FEATURE_KINDS; `types`, text where a column has none): a cell that is not a value of
    an int or float column, or an empty cell, is a missing feature, which the record rule maps
    to the feature's public default one record at a time."""
    with tf.io.gfile.GFile(path, "rb") as handle:
        table = text_csv(handle.read(), f"CSV file {os.path.basename(path)}")
    types = types or {}
    columns = []
    for name in table.column_names:
        text = pc.utf8_trim_whitespace(table[name]).to_pandas()
        kind = types.get(name, "string")
        values = typed_cells(text, kind).to_pylist()
        columns.append((name, FEATURE_KINDS[kind], [
            None if cell == "" else value for cell, value in zip(text, values)]))
    for row in range(table.num_rows):
        example = tf.train.Example()
        for name, kind, values in columns:
            value = values[row]
            if value is not None:
                getattr(example.features.feature[name], kind).value.append(
                    value.encode("utf-8") if kind == "bytes_list" else value)
        # Deterministic bytes: the train/eval split hashes them, and a feature map's order
        # otherwise differs between processes, which moved records between splits.
        yield example.SerializeToString(deterministic=True)


def check_csv_headers(files: list[str], columns: Optional[list[str]], block_key: str) -> None:
    """Refuse (BadRequest) a CSV file whose header does not match the table's public schema:
    `columns`, the declared column names (any order), or without a declaration the first
    file's header; the block key must be one of them. The executor asks before it writes or
    registers anything, so a missing column is a schema error rather than a silently missing
    feature in every record (which trained, and charged, on what the other columns held).

    The message names only declared columns (public). A header's own text is named by its
    position only: in a file without a header line, the "header" is a record, and an error
    (kept in logs and ML Metadata) must not carry a cell."""
    expected = list(columns) if columns is not None else None
    for path in files:
        with tf.io.gfile.GFile(path, "rb") as handle:
            header = header_of(handle)  # the first line alone; no decoding error
        name = os.path.basename(path)
        if expected is None:
            expected = header
            if block_key not in header:
                raise BadRequest(f"the block key {block_key!r} is not in the header of {name} "
                                 "(declare the table's columns with columns=[...]); nothing "
                                 "was registered")
            continue
        if sorted(header) == sorted(set(expected)) and len(header) == len(set(header)):
            continue
        if columns is None:
            differing = [str(position + 1) for position in
                         range(max(len(header), len(expected)))
                         if position >= len(header) or position >= len(expected)
                         or header[position] not in expected
                         or expected[position] not in header]
            raise BadRequest(f"CSV file {name}: its header does not match the header of "
                             f"{os.path.basename(files[0])} ({len(header)} against "
                             f"{len(expected)} columns; differing at position(s) "
                             f"{', '.join(differing) or 'none: a column is repeated'}); declare "
                             "the table's columns with columns=[...] to have them named; "
                             "nothing was registered")
        missing = [column for column in expected if column not in header]
        extra = [str(position + 1) for position, column in enumerate(header)
                 if column not in expected]
        repeated = sorted({column for column in expected if header.count(column) > 1})
        problems = ([f"missing column(s) {', '.join(repr(c) for c in missing)}"] if missing
                    else []) + ([f"undeclared column(s) at position(s) {', '.join(extra)}"]
                                if extra else []) + (
            [f"repeated column(s) {', '.join(repr(c) for c in repeated)}"] if repeated else [])
        raise BadRequest(f"CSV file {name}: {'; '.join(problems)} against the declared columns "
                         f"{expected}; nothing was registered")
    if columns is not None and block_key not in columns:
        raise BadRequest(f"the block key {block_key!r} is not a declared column "
                         f"({list(columns)}): every record would be dropped; nothing was "
                         "registered")
