"""The user's own calls, named from a traced preprocessing_fn: which raw feature a tensor comes
from, and which tensorflow_transform function made an analyzer node (its name scope), so that
DPTransform's messages say "scale_to_z_score(fare)", not "ExtractCombineMergeOutputs"."""
from __future__ import annotations

import re
from typing import Iterable, Mapping

import tensorflow as tf

# Ops whose output holds the same values as their first input (a feature read through
# _fill_in_missing, a cast, a reshape): a feature's declared bounds apply through them.
VALUE_PRESERVING = frozenset({"Identity", "Cast", "Reshape", "Squeeze", "ExpandDims",
                              "StopGradient", "EnsureShape"})


def features_by_tensor(inputs: Mapping) -> dict:
    """{tensor.ref(): raw feature name} of a preprocessing_fn's dense inputs."""
    return {value.ref(): name for name, value in inputs.items() if isinstance(value, tf.Tensor)}


def _ancestors(tensor: tf.Tensor) -> Iterable[tf.Tensor]:
    seen, pending = set(), [tensor]
    while pending:
        current = pending.pop()
        if current.ref() in seen:
            continue
        seen.add(current.ref())
        yield current
        pending.extend(current.op.inputs)


def features_of(tensor, features: Mapping) -> list[str]:
    """The raw features (`features`: {tensor.ref(): name}) that `tensor` is computed from."""
    if not isinstance(tensor, tf.Tensor):
        return []
    return sorted({features[t.ref()] for t in _ancestors(tensor) if t.ref() in features})


def feature_name(tensor, features: Mapping) -> str:
    """How a message names what `tensor` holds: its raw feature(s), else its op's name."""
    names = features_of(tensor, features)
    if names:
        return ", ".join(names)
    return getattr(getattr(tensor, "op", None), "name", "a tensor")


def same_values_as_feature(tensor, features: Mapping):
    """The raw feature whose values `tensor` holds unchanged (through VALUE_PRESERVING ops),
    or None (a computed value: its bounds are not the feature's)."""
    while isinstance(tensor, tf.Tensor):
        if tensor.ref() in features:
            return features[tensor.ref()]
        if tensor.op.type not in VALUE_PRESERVING or not tensor.op.inputs:
            return None
        tensor = tensor.op.inputs[0]
    return None


def _scope(label: str) -> str:
    """"ExtractCombineMergeOutputs[scale_to_z_score#mean_and_var]" -> the bracketed scope."""
    match = re.search(r"\[(.*)\]$", label)
    return match.group(1) if match else label


def tft_function(scope: str) -> str:
    """The outermost tensorflow_transform function in an analyzer's name scope (the user's
    call: tft.scale_to_z_score calls tft.mean_and_var inside its own scope); TF numbers
    repeated scopes (scale_to_z_score_1), which is dropped."""
    import tensorflow_transform

    for part in re.split(r"[#/]", scope):
        name = re.sub(r"_\d+$", "", part)
        if callable(getattr(tensorflow_transform, name, None)) and not name.startswith("_"):
            return name
    return scope


def user_calls(definitions, features: Mapping) -> list[str]:
    """The user's calls behind TFT analyzer nodes (AnalyzerDefs of a traced graph), as
    "function(feature)", in the order first met, without repeats. The feature is read from the
    analyzer's TensorSource, which carries the same scope."""
    from tensorflow_transform import analyzer_nodes

    sources = {_scope(d.label): d.tensors for d in definitions
               if isinstance(d, analyzer_nodes.TensorSource)}
    calls: list[str] = []
    for definition in definitions:
        if isinstance(definition, analyzer_nodes.TensorSource):
            continue
        scope = _scope(definition.label)
        names = sorted({name for tensor in sources.get(scope, ())
                        for name in features_of(tensor, features)})
        call = f"{tft_function(scope)}({', '.join(names)})"
        if call not in calls:
            calls.append(call)
    return calls
