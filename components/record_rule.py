"""The record rule: what every DP component does with a record whose content is bad.

Why. A DP component runs after its grant was charged. If one record's content could make it
raise (a missing feature, a value list of the wrong length or type, bytes that are no
tf.Example) or turn its output into NaN (NaN and infinities pass through np.clip,
tf.clip_by_value and C / max(C, norm), so one NaN makes a clipped sum NaN), then whether a run
releases anything, and what, would depend on one record beyond what the mechanism's noise
covers. So before any bounding, each record is mapped to a valid one by a function of that
record alone whose output for bad content is a public constant:

* `sanitise_records` (raw records, before parsing): every feature of the feature spec is kept
  if it has the spec's type (a number of the other numeric type is converted when exact, text
  holding a number to that number, an integer to its decimal text: a reader that types a column
  from all its cells, as TFX's CsvExampleGen does, then cannot let one record move the others)
  and, for a FixedLenFeature, exactly the spec's number of values; otherwise it becomes the
  feature's default. Non-finite float values become the default
  value one by one. Features outside the spec are dropped, and bytes that do not parse as a
  tf.Example are read as an empty one (every feature default).
* `finite` (derived tensors: model inputs, labels, predictions): non-finite entries become 0.

The default of a feature is its spec's `default_value` when the module file sets one (the
module is public, like every bound), otherwise 0 for numbers and b"" for strings: constants,
never statistics of the data.

The guarantee. Both maps act on each record independently, so a dataset D becomes
f(D) = {f(x) : x in D}, and D, D' differing by one record give f(D), f(D') differing by one
record: every add-or-remove-one mechanism run on f(D) keeps its guarantee for D. And after the
map every record parses and every derived value is finite, so no record can make a component
raise or release NaN after its charge.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError

_KINDS = {tf.float32: "float_list", tf.int64: "int64_list", tf.string: "bytes_list"}


class RecordRuleError(ValueError):
    """A feature spec the record rule cannot apply (raised before any record is read)."""


def _kind(name: str, spec) -> str:
    if not isinstance(spec, (tf.io.FixedLenFeature, tf.io.VarLenFeature)):
        raise RecordRuleError(f"feature {name!r}: DP components read FixedLenFeature and "
                              f"VarLenFeature only, got {type(spec).__name__}")
    if spec.dtype not in _KINDS:
        raise RecordRuleError(f"feature {name!r}: dtype {spec.dtype!r} is not one of "
                              "float32, int64, string")
    return _KINDS[spec.dtype]


def _size(spec) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) if spec.shape else 1


def defaults(name: str, spec) -> list:
    """The public default values of one feature (FixedLenFeature: all of its values)."""
    scalar = b"" if spec.dtype == tf.string else 0
    if not isinstance(spec, tf.io.FixedLenFeature):
        return []
    if spec.default_value is None:
        return [scalar] * _size(spec)
    values = np.broadcast_to(np.asarray(spec.default_value, dtype=object), spec.shape or [])
    values = list(values.reshape(-1))
    if spec.dtype == tf.float32 and not all(math.isfinite(v) for v in values):
        raise RecordRuleError(f"feature {name!r}: its default_value must be finite")
    return values


def check_spec(feature_spec: Mapping) -> None:
    """Raise RecordRuleError unless the rule applies to every feature of the spec."""
    for name, spec in feature_spec.items():
        _kind(name, spec)
        defaults(name, spec)


def _number(text: bytes, kind: str):
    """The number a text cell holds, as `kind` (int64 only when exact), or None."""
    try:
        text = text.decode("ascii").strip()
        if kind == "int64_list":
            try:
                return _whole(int(text))
            except ValueError:
                return _whole(float(text))
        return float(text)  # NaN and infinities: the float rule below maps them
    except (ValueError, OverflowError):  # UnicodeDecodeError is a ValueError
        return None


def _whole(number):
    """`number` as an int64 value when it is a whole number in int64's range, else None."""
    if math.isfinite(number) and number == int(number) and -2 ** 63 <= number < 2 ** 63:
        return int(number)
    return None


def _values_as(feature, kind: str):
    """The feature's values as `kind`, or None. Numbers cross between int64 and float: input
    read one record at a time (CSV) types each cell on its own, so "12" in a float column is an
    int64 value; a float is an int64 value only if it is a whole number in int64's range.
    Text and numbers cross too, each value on its own: TFX's CsvExampleGen types a column from
    ALL its cells, so one unit's unreadable cell turns a number column into text for every
    record (which would then all read as the default), and a text column whose cells all look
    like integers is read as int64 (an integer reads back as its decimal text)."""
    if feature is None or feature.WhichOneof("kind") is None:
        return None
    have = feature.WhichOneof("kind")
    values = list(getattr(feature, have).value)
    if have == kind:
        return values
    if have == "bytes_list":
        numbers = [_number(v, kind) for v in values]
        return None if None in numbers else numbers
    if kind == "bytes_list":
        return [str(v).encode() for v in values] if have == "int64_list" else None
    if have == "int64_list" and kind == "float_list":
        return [float(v) for v in values]
    numbers = [_whole(v) for v in values]  # float_list as int64_list
    return None if None in numbers else numbers


def _sanitised(example: tf.train.Example, feature_spec: Mapping) -> tf.train.Example:
    clean = tf.train.Example()
    for name, spec in feature_spec.items():
        kind = _kind(name, spec)
        values = _values_as(example.features.feature.get(name), kind)
        fill = defaults(name, spec)
        if values is None or (isinstance(spec, tf.io.FixedLenFeature) and len(values) != len(fill)):
            values = fill
        elif kind == "float_list":
            # FixedLen: the default at the same position; VarLen has no positions to keep, 0.
            values = [v if math.isfinite(v) else (fill[i] if fill else 0.0)
                      for i, v in enumerate(values)]
        getattr(clean.features.feature[name], kind).value.extend(values)
    return clean


def null_record(feature_spec: Mapping) -> bytes:
    """A record with every feature at its public default: what null and dummy slots and the
    decoders' shape-fixing first row are decoded from (the same as sanitising b"")."""
    return _sanitised(tf.train.Example(), feature_spec).SerializeToString()


def sanitise_record(serialized: bytes, feature_spec: Mapping) -> bytes:
    """One serialized record, mapped to a valid one of `feature_spec` (module docstring)."""
    try:
        example = tf.train.Example.FromString(serialized)
    except DecodeError:  # bytes that are no tf.Example: read as an empty record
        example = tf.train.Example()
    return _sanitised(example, feature_spec).SerializeToString()


def readable_scalars(serialized: Iterable[bytes], feature_spec: Mapping,
                     strings: bool = False) -> dict[str, np.ndarray]:
    """For each scalar int or float feature of `feature_spec` (with `strings`, each scalar
    string feature too): per record, whether it holds one value of that kind, finite for a
    float (what `sanitise_record` keeps rather than defaults). The DP statistics read a record
    without one as NULL (missing), skipped by an aggregate, not as its default 0 or "" (a
    per-record map: whether one record's value is NULL depends on that record alone)."""
    check_spec(feature_spec)
    kinds = (tf.int64, tf.float32, tf.string) if strings else (tf.int64, tf.float32)
    scalar = {name: _kind(name, spec) for name, spec in feature_spec.items()
              if isinstance(spec, tf.io.FixedLenFeature) and _size(spec) == 1
              and spec.dtype in kinds}
    readable = {name: [] for name in scalar}
    for record in serialized:
        try:
            example = tf.train.Example.FromString(record)
        except DecodeError:
            example = tf.train.Example()
        for name, kind in scalar.items():
            values = _values_as(example.features.feature.get(name), kind)
            readable[name].append(values is not None and len(values) == 1
                                  and (kind == "bytes_list" or math.isfinite(values[0])))
    return {name: np.array(flags, dtype=bool) for name, flags in readable.items()}


def sanitise_records(serialized: Iterable[bytes], feature_spec: Mapping) -> list[bytes]:
    """`sanitise_record` on each record; the spec is checked first, so a spec the rule cannot
    apply is refused whatever the data."""
    check_spec(feature_spec)
    return [sanitise_record(record, feature_spec) for record in serialized]


def _fixed_or_default(parsed: tf.sparse.SparseTensor, name: str, spec) -> tf.Tensor:
    """A FixedLenFeature parsed as a VarLenFeature of its dtype ([batch, any]), made dense as
    `_sanitised` makes each record: a row holding exactly the spec's number of values keeps
    them, any other row (none: a missing feature or an empty list; too many or too few) is
    the feature's defaults. [batch, *spec.shape]."""
    fill = tf.constant(defaults(name, spec), spec.dtype)
    rows = tf.RaggedTensor.from_sparse(parsed)
    exact = tf.equal(rows.row_lengths(), _size(spec))[:, None]
    values = tf.where(exact, rows.to_tensor(shape=[None, _size(spec)]), fill[None, :])
    return tf.reshape(values, [-1, *spec.shape])


def parse_with_defaults(serialized: tf.Tensor, feature_spec: Mapping) -> dict:
    """tf.io.parse_example in the graph (a serving signature), with the rule's defaults where
    the Python rule (`sanitise_records`) cannot run. Mapped as training maps them: a
    FixedLenFeature that is missing or holds another number of values than its spec (an empty
    list, two values for one) is its public default (`_fixed_or_default`), and each
    non-finite float value the default at its position (0 in a VarLenFeature). Not mapped: a
    value list of another type than the spec's (training converts an exact number between
    int64 and float and text holding a number, `_values_as`; tf.io.parse_example cannot),
    and bytes that are no tf.Example; such a request fails (serving may refuse a malformed
    request; no DP run depends on it)."""
    check_spec(feature_spec)
    spec = {name: tf.io.VarLenFeature(feature.dtype) for name, feature in feature_spec.items()}
    parsed = tf.io.parse_example(serialized, spec)
    for name, feature in feature_spec.items():
        if isinstance(feature, tf.io.FixedLenFeature):
            parsed[name] = _fixed_or_default(parsed[name], name, feature)
        if feature.dtype != tf.float32:
            continue
        if isinstance(feature, tf.io.FixedLenFeature):
            fill = tf.broadcast_to(tf.reshape(tf.constant(defaults(name, feature), tf.float32),
                                              feature.shape or []), tf.shape(parsed[name]))
            parsed[name] = tf.where(tf.math.is_finite(parsed[name]), parsed[name], fill)
        else:
            values = parsed[name].values
            parsed[name] = parsed[name].with_values(
                tf.where(tf.math.is_finite(values), values, tf.zeros_like(values)))
    return parsed


def finite(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor with every NaN or infinite entry replaced by 0 (integers pass unchanged)."""
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return tensor
    return tf.where(tf.math.is_finite(tensor), tensor, tf.zeros_like(tensor))
