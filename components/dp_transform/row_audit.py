"""Trace-time proof that a preprocessing_fn treats each record on its own, outside DP analyzers.

Why. TFT runs a preprocessing_fn on Beam batches of records. An op whose output row i depends on
other rows than i (`x - tf.reduce_mean(x)`, a sort, `tf.shape(x)[0]` in arithmetic) mixes the
records of a batch: what one record becomes then depends on others, with no noise and no
budget, and the batches themselves are an arbitrary, data-dependent grouping. So the transform
of record x must be a function of x alone and of constants: the DP analyzers' releases (bound
into the graph as constants), the module's own constants.

How. The executor traces the preprocessing_fn (no data) and this module labels every tensor:
  CONST       depends on no input (constants, analyzer releases, shapes known statically);
  ROW         axis 0 is the batch, row i depends only on record i and constants;
  BATCH_SIZE  holds the size of the batch (tf.shape of a ROW tensor): allowed only as the
              dimensions of tf.fill / tf.zeros / tf.reshape, never in arithmetic or as a value;
  MIXED       anything else, with the op that made it so.
An op that reads a ROW (or BATCH_SIZE) tensor gives ROW only if its type is on the allow-list
below and its arguments keep rows apart (axis 0 untouched, no broadcast of a constant across
rows); every other op, including any op we do not know, gives MIXED. This is an allow-list,
not a deny-list of reductions, because TensorFlow has hundreds of ops that mix rows
(reductions, scans, sorts, MatMul on the left, segment ops, tf.range over the batch, gathers
by position, control flow, functions) and new ones appear with each release: a deny-list is
unsound by default, an allow-list only refuses too much. Every ROW tensor must also have the
static shape [None, known...] (the batch, then a fixed row shape), which catches broadcasts
such as [B] + [B, 1] -> [B, B] and slices or expands along axis 0.

Refused: any output of the preprocessing_fn, or any input of a DP analyzer (the analyzers bound
one record's contribution, which holds only if their inputs are per-record), that is MIXED or
BATCH_SIZE. Sparse features and outputs are refused too: their values are not rows.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import tensorflow as tf
from tensorflow.python.framework import tensor_util

CONST, ROW, BATCH_SIZE, MIXED = "constant", "per-row", "batch size", "mixed"

# Output element (i, ...) depends only on the same element of each input (with broadcasting,
# checked by the static-shape rule), or on the element's own row.
ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "AddV2", "Asin", "Asinh", "AsString", "Atan", "Atan2",
    "Atanh", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Bucketize", "Cast", "Ceil",
    "CheckNumerics", "ClipByValue", "Cos", "Cosh", "Div", "DivNoNan", "Elu", "Equal", "Erf",
    "Erfc", "Exp", "Expm1", "Floor", "FloorDiv", "FloorMod", "Greater", "GreaterEqual",
    "Identity", "Inv", "Invert", "IsFinite", "IsInf", "IsNan", "LeakyRelu", "Less",
    "LessEqual", "Log", "Log1p", "LogicalAnd", "LogicalNot", "LogicalOr", "Maximum", "Minimum",
    "Mod", "Mul", "MulNoNan", "Neg", "NotEqual", "OnesLike", "Pow", "RealDiv", "Reciprocal",
    "Relu", "Relu6", "Rint", "Round", "Rsqrt", "Select", "SelectV2", "Selu", "Sigmoid", "Sign",
    "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Square", "SquaredDifference", "StopGradient",
    "StringToHashBucketFast", "StringToHashBucketStrong", "StringToNumber", "Sub", "Tan", "Tanh",
    "TruncateDiv", "TruncateMod", "Xdivy", "Xlogy", "ZerosLike", "LookupTableFindV2",
    "StringLower", "StringUpper", "StringStrip"})
# Reshape-like: row i of the output is row i of the input when both have the batch first and
# the same number of elements per row (row-major order).
RESHAPES = frozenset({"Reshape", "ExpandDims", "Squeeze", "EnsureShape"})
# Reductions and scans along axes other than 0 stay in their row.
REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin",
                        "Cumsum", "Cumprod"})
# Stateful ops that only read their state (a lookup in a constant table).
READ_ONLY_STATEFUL = frozenset({"LookupTableFind", "LookupTableFindV2"})
# Ops that carry the batch size without using it as a number.
SIZE_CARRIERS = frozenset({"Shape", "StridedSlice", "Pack", "ConcatV2", "Cast", "Identity"})


class Verdict:
    """A tensor's label and, for MIXED, the op that made it so."""
    __slots__ = ("kind", "reason")

    def __init__(self, kind: str, reason: str = ""):
        self.kind, self.reason = kind, reason


def _static(tensor: tf.Tensor):
    value = tensor_util.constant_value(tensor)
    return None if value is None else value.tolist()


def _rows_ok(tensor: tf.Tensor) -> bool:
    """The static shape [None, known...]: the batch first, then a fixed row shape."""
    shape = tensor.shape
    return (shape.rank is not None and shape.rank >= 1 and shape[0] is None
            and all(dim is not None for dim in shape[1:]))


def _row_size(tensor: tf.Tensor) -> int:
    return math.prod(tensor.shape[1:])


def _normalised_axes(axes, rank: Optional[int]) -> Optional[list[int]]:
    if axes is None or rank is None:
        return None
    axes = axes if isinstance(axes, list) else [axes]
    return [axis % rank for axis in axes]


def _mixed(op: tf.Operation, why: str) -> Verdict:
    return Verdict(MIXED, f"op {op.name!r} ({op.type}) {why}")


def _row_rule(op: tf.Operation, kinds: list[str]) -> Verdict:
    """The label of op's outputs when some input is ROW or BATCH_SIZE (none MIXED)."""
    inputs = list(op.inputs)
    rows = [t for t, k in zip(inputs, kinds) if k == ROW]
    if BATCH_SIZE in kinds and op.type not in SIZE_CARRIERS | {"Fill"} | RESHAPES:
        return _mixed(op, "uses the batch size (tf.shape of the batch) as a value")
    if op.type in SIZE_CARRIERS and not rows:
        return Verdict(BATCH_SIZE)
    if op.type == "Shape":
        return Verdict(BATCH_SIZE)
    if op.type in ELEMENTWISE:
        if len({t.shape.rank for t in rows}) != 1:
            return _mixed(op, "combines per-row tensors of different ranks (a broadcast across "
                              "rows)")
        return Verdict(ROW)
    if op.type in RESHAPES:
        if kinds[0] != ROW or not _rows_ok(inputs[0]):
            return _mixed(op, "reshapes something that is not a per-row tensor")
        if not _rows_ok(op.outputs[0]) or _row_size(op.outputs[0]) != _row_size(inputs[0]):
            return _mixed(op, f"reshapes {inputs[0].shape} to {op.outputs[0].shape}: rows do "
                              "not map to rows")
        return Verdict(ROW)
    if op.type == "Fill":
        if kinds[0] == ROW or kinds[1] != CONST:
            return _mixed(op, "fills with per-row dimensions or values")
        return Verdict(ROW)
    if op.type in REDUCTIONS:
        axes = _normalised_axes(_static(inputs[1]), inputs[0].shape.rank)
        if kinds[0] != ROW or kinds[1] != CONST or axes is None or 0 in axes:
            return _mixed(op, "reduces across the batch (axis 0); only the DP analyzers may")
        return Verdict(ROW)
    if op.type in ("ConcatV2", "Pack"):
        values = inputs[:-1] if op.type == "ConcatV2" else inputs
        rank = values[0].shape.rank
        axis = (_static(inputs[-1]) if op.type == "ConcatV2" else op.get_attr("axis"))
        axes = _normalised_axes(axis, None if rank is None else rank + (op.type == "Pack"))
        if any(k != ROW for k in kinds[:len(values)]) or axes is None or axes == [0]:
            return _mixed(op, "joins tensors along the batch axis, or joins a per-row tensor "
                              "with another one")
        return Verdict(ROW)
    if op.type == "GatherV2":
        axis, batch_dims = _static(inputs[2]), op.get_attr("batch_dims")
        if kinds[0] == CONST and kinds[1] == ROW and axis == 0 and batch_dims == 0:
            return Verdict(ROW)  # a lookup in constants (e.g. a DP release) by a per-row key
        rank = inputs[0].shape.rank
        if (kinds[0] == ROW and kinds[1] == CONST and batch_dims == 0
                and _normalised_axes(axis, rank) not in (None, [0])):
            return Verdict(ROW)
        return _mixed(op, "gathers across rows")
    if op.type == "StridedSlice":
        return _strided_slice(op, kinds)
    if op.type == "MatMul":
        if (kinds[0] == ROW and kinds[1] == CONST and not op.get_attr("transpose_a")):
            return Verdict(ROW)
        return _mixed(op, "multiplies across the batch (only x @ constant keeps rows apart)")
    if op.type == "OneHot":
        return Verdict(ROW) if kinds[0] == ROW and set(kinds[1:]) == {CONST} else _mixed(
            op, "has per-row depth or values")
    return _mixed(op, "is not on DPTransform's allow-list of per-row ops")


def _strided_slice(op: tf.Operation, kinds: list[str]) -> Verdict:
    """x[...] keeps rows apart iff its spec leaves axis 0 whole: `x[:, ...]` or an ellipsis
    first that covers axis 0."""
    source, begin = op.inputs[0], _static(op.inputs[1])
    strides = _static(op.inputs[3])
    if kinds[0] != ROW or set(kinds[1:]) != {CONST} or begin is None or strides is None:
        return _mixed(op, "slices with per-row or non-constant bounds")
    begin_mask, end_mask = op.get_attr("begin_mask"), op.get_attr("end_mask")
    ellipsis, new_axis = op.get_attr("ellipsis_mask"), op.get_attr("new_axis_mask")
    shrink = op.get_attr("shrink_axis_mask")
    whole_first = (begin_mask & end_mask & 1 and strides[0] == 1 and not (shrink | new_axis) & 1
                   and not ellipsis & 1)
    specified = len(begin) - 1 - bin(new_axis).count("1")
    rank = source.shape.rank
    ellipsis_first = ellipsis & 1 and rank is not None and rank - specified >= 1
    if not (whole_first or ellipsis_first):
        return _mixed(op, "slices along the batch axis")
    return Verdict(ROW)


def _components(value) -> Iterable[tf.Tensor]:
    if isinstance(value, tf.Tensor):
        return [value]
    return [None]  # sparse or ragged: no rows to check


def label_graph(graph: tf.Graph, row_inputs: Iterable[tf.Tensor]) -> dict[str, Verdict]:
    """The label of every tensor of `graph` (its ops are in creation, hence topological, order;
    control flow ops, which could loop, are not on the allow-list)."""
    verdicts = {tensor.name: Verdict(ROW) for tensor in row_inputs}
    for op in graph.get_operations():
        if all(t.name in verdicts for t in op.outputs) and op.outputs:
            continue
        inputs = [verdicts.get(t.name, Verdict(CONST)) for t in op.inputs]
        mixed = [v for v in inputs if v.kind == MIXED]
        kinds = [v.kind for v in inputs]
        if mixed:
            verdict = mixed[0]
        elif all(k == CONST for k in kinds):
            verdict = Verdict(CONST)
        else:
            verdict = _row_rule(op, kinds)
        for tensor in op.outputs:
            if verdict.kind == ROW and not _rows_ok(tensor):
                verdicts[tensor.name] = _mixed(op, f"gives shape {tensor.shape}, not "
                                                   "[batch, fixed row shape]")
            elif verdict.kind == BATCH_SIZE and _static(tensor) is not None:
                verdicts[tensor.name] = Verdict(CONST)  # e.g. tf.shape(x)[1]: known statically
            else:
                verdicts[tensor.name] = verdict
    return verdicts


def problems(graph: tf.Graph, inputs: dict, outputs: dict,
             analyzer_inputs: Iterable[tf.Tensor]) -> list[str]:
    """Why the traced preprocessing_fn is not per-row (empty if it is)."""
    found = []
    for name, value in inputs.items():
        if not isinstance(value, tf.Tensor):
            found.append(f"feature {name!r} is sparse or ragged: DPTransform reads "
                         "FixedLenFeatures only")
    if found:
        return found
    verdicts = label_graph(graph, inputs.values())
    # A stateful op fed by records (an assignment to a variable, a table insert) could carry
    # one batch's records into any later read of that state, which the labels above (data
    # flow only) would not see.
    for op in graph.get_operations():
        fed = any(verdicts.get(t.name, Verdict(CONST)).kind != CONST for t in op.inputs)
        if fed and op.op_def.is_stateful and op.type not in READ_ONLY_STATEFUL:
            found.append(f"op {op.name!r} ({op.type}) writes state from the records")
    roots = [(f"output {name!r}", tensor) for name, value in outputs.items()
             for tensor in _components(value)]
    roots += [("a DP analyzer's input", tensor) for tensor in analyzer_inputs]
    for what, tensor in roots:
        if tensor is None:
            found.append(f"{what} is sparse or ragged: DPTransform outputs dense features only")
            continue
        verdict = verdicts.get(tensor.name, Verdict(CONST))
        if verdict.kind == MIXED:
            found.append(f"{what} mixes the records of a batch: {verdict.reason}")
        elif verdict.kind == BATCH_SIZE:
            found.append(f"{what} is the batch size")
    return found
