"""The user's module file, like TFX Trainer's module, and how records become tensors.

A module defines:
    LABEL_KEY = "trip_seconds"   # the label: a raw feature, or a feature the transform outputs
    def build_model() -> tf.keras.Model   # dp_sgd: float32, each example on its own
and, where needed:
    def feature_spec() -> dict[str, tf.io.FixedLenFeature]   # raw features, label included
    def model_inputs(features: dict[str, tf.Tensor]) -> tf.Tensor   # [batch, d] float32
    def loss() -> tf.keras.losses.Loss    # dp_sgd: per-example loss of the task

A TFX Trainer module converts as it is (TFX's taxi template: docs and
components/dp_trainer/README.md):
* The builder may have another name: DPTrainer(model_fn="_build_keras_model") calls it with no
  arguments. `run_fn` is not called: DPTrainer trains (DP-SGD) and exports the model itself.
* `feature_spec()` is needed only without a TransformGraph (with one, the raw spec is the
  transform's). AdaSSP needs `model_inputs`.
* Without `model_inputs`, the model's inputs are its named Keras Inputs (a functional model's
  `tf.keras.Input(name=...)`), each read from the feature of that name (the transformed one
  with a TransformGraph), cast to the Input's dtype and reshaped to its shape: a transformed
  feature of shape [batch] feeds an Input of shape (1,); one of another number of values per
  example than the Input's is refused. A float value outside an integer
  Input's range is clamped to it (so the cast is the same on every CPU).
* Without `loss()`, DP-SGD trains the loss the model was compiled with (`model.compile(loss=
  "binary_crossentropy", ...)`), one value per example (losses.compiled_loss; refused before
  the charge when it cannot be made per-example). The compiled optimizer is replaced by
  DP-SGD's (the log says so); compiled metrics are not used.
(DP-SGD refuses, before the charge, a model or loss that mixes the examples of a batch, keeps
state across steps or checks values: dp_trainer/stand_in.py.)
With a TransformGraph, records are parsed with its raw feature spec and transformed first;
`model_inputs` (or the named Inputs) then receive the transformed features, and the label is
taken from them when present (a transformed label such as `tips_xf`), otherwise from the raw
features.

Bad records (components/record_rule.py): the decoder sanitises every record before parsing
(missing, malformed or non-finite features become their public defaults) and maps non-finite
model inputs and labels to 0, so no record's content can make a DP component raise or train on
NaN after its grant was charged. Serving applies the same defaults in the graph
(`serving_inputs`, `transformed_features`: the SavedModel's signatures; record_rule.
parse_with_defaults: a missing feature, another number of values, a non-finite float) and the
same `finite` map to model inputs; a value list of another type than the spec's, which
training converts, fails a serving request.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from sage_tfx.components.record_rule import (check_spec, finite, null_record,
                                              parse_with_defaults, sanitise_records)
from sage_tfx.components.util.losses import compiled_loss

# What every use of a module needs; each component adds what its mode or metric needs
# (dp_trainer.parameters.module_needs, validators.executor.MODULE_NEEDS) and, without a
# TransformGraph, RAW_SPEC_NEEDS.
ALWAYS_NEEDED = ("LABEL_KEY",)
RAW_SPEC_NEEDS = ("feature_spec",)  # the raw features, when no TransformGraph gives them
DEFAULT_MODEL_FN = "build_model"
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_module_path(name: str) -> bool:
    """`package.module`, as opposed to a file: no path separator and no `.py`."""
    return bool(MODULE_PATH.fullmatch(name or "")) and not name.endswith(".py")


def import_module_file(path: str):
    """The user's module (DPTrainer, DPTransform, SLAedValidator): a file, imported from its
    path, or a module path (`package.module`) importable in this environment; the latter does
    not depend on where the code sits on one machine (a compiled Kubeflow job uses it)."""
    if path and os.path.isfile(path):
        spec = importlib.util.spec_from_file_location(f"sage_user_module_{abs(hash(path))}",
                                                      path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if is_module_path(path):
        try:
            found = importlib.util.find_spec(path)
        except ModuleNotFoundError:  # a parent package is missing
            found = None
        if found is not None:
            return importlib.import_module(path)
        raise ValueError(f"module file {path!r} is neither a file nor an importable module")
    raise ValueError(f"module file {path!r} does not exist")


def raw_spec_needs(transform_graph: bool) -> tuple[str, ...]:
    """What a module needs for its raw features: nothing with a TransformGraph (its raw spec
    is the transform's), else feature_spec()."""
    return () if transform_graph else RAW_SPEC_NEEDS


@dataclass(frozen=True)
class UserModule:
    label_key: str
    feature_spec: Optional[Callable[[], dict]]
    model_inputs: Optional[Callable[[dict], tf.Tensor]]
    build_model: Optional[Callable[[], tf.keras.Model]]
    loss: Optional[Callable[[], tf.keras.losses.Loss]]

    @classmethod
    def load(cls, path: str, purpose: str, needs: Sequence[str] = (),
             model_fn: Optional[str] = None) -> "UserModule":
        """The module at `path`; ValueError if it lacks what `purpose` `needs` (beyond
        ALWAYS_NEEDED). `model_fn` names the function that builds the model (DPTrainer's
        parameter, default build_model; `needs` lists it as build_model)."""
        module = import_module_file(path)
        builder = model_fn or DEFAULT_MODEL_FN
        wanted = [*ALWAYS_NEEDED, *(builder if name == DEFAULT_MODEL_FN else name
                                    for name in needs)]
        missing = [name for name in wanted if not hasattr(module, name)]
        if missing:
            why = (" (the raw features: define it, or give the component the TransformGraph, "
                   "whose raw feature spec is used)" if "feature_spec" in missing else "")
            raise ValueError(f"module file {path} lacks {missing} (needed for "
                             f"{str(purpose)!r}){why}")
        return cls(module.LABEL_KEY, getattr(module, "feature_spec", None),
                   getattr(module, "model_inputs", None), getattr(module, builder, None),
                   getattr(module, "loss", None))

    def training_loss(self, model: tf.keras.Model) -> tf.keras.losses.Loss:
        """The module's loss(), else the loss `model` was compiled with, made per-example
        (ValueError naming why when it cannot be)."""
        return self.loss() if self.loss is not None else compiled_loss(model)


def declared_inputs(model: tf.keras.Model) -> dict[str, tf.TensorSpec]:
    """The model's named Keras Inputs: name -> the spec of one example (ValueError for a model
    without them, or with an Input of a shape not fully known)."""
    if not getattr(model, "_is_graph_network", False) or not model.inputs:
        raise ValueError("the model declares no named Inputs (a subclassed model?): define "
                         "model_inputs(features) in the module, or build a functional model "
                         "on tf.keras.Input(name=...)")
    specs = {name: tf.TensorSpec(tensor.shape[1:], tensor.dtype)
             for name, tensor in zip(model.input_names, model.inputs)}
    unknown = sorted(name for name, spec in specs.items() if not spec.shape.is_fully_defined())
    if unknown:
        raise ValueError(f"the model's Inputs {unknown} have shapes not fully known "
                         f"({[specs[name].shape for name in unknown]}): give each Input a "
                         "fixed shape, or define model_inputs(features)")
    return specs


def _integer_range(dtype: tf.DType) -> tuple[float, float]:
    """The float64 values nearest an integer dtype's range, inside it."""
    low, high = float(dtype.min), float(dtype.max)
    return low, high if high <= dtype.max else float(np.nextafter(high, 0.0))


def as_input(name: str, feature, spec: tf.TensorSpec) -> tf.Tensor:
    """A decoded feature as the model's Input `name` of one example's `spec`: non-finite
    floats 0 (record_rule.finite), cast to the Input's dtype (a float clamped to an integer
    dtype's range first: the cast of a value beyond it differs by CPU) and reshaped to
    [batch, *spec.shape] (a feature of shape [batch] feeds an Input of shape (1,)). A feature
    of another number of values per example than the Input's is refused before the charge, not
    reshaped into another batch size ([B, 2] into (1,) as [2B, 1]). When that number is known
    only when the graph runs (a dense view of a variable-length feature, whose width is the
    batch's longest record), each example is fitted to the Input: its first values, zero-padded.
    An assertion there would let one record's length fail the run after its charge; the fit
    reads each example alone, so no record moves another one's input."""
    if not isinstance(feature, tf.Tensor):
        raise ValueError(f"the model's Input {name!r} is fed a {type(feature).__name__}: "
                         "make the feature dense (a FixedLenFeature, or densify it in the "
                         "preprocessing_fn)")
    value = finite(feature)
    size, per_example = spec.shape.num_elements(), value.shape[1:].num_elements()
    if per_example is not None and per_example != size:
        raise ValueError(
            f"the feature {name!r} has {per_example} values per example (shape "
            f"{value.shape[1:]}) and the model's Input {name!r} takes {size} (shape "
            f"{spec.shape}): shape the feature as the Input, or define model_inputs(features)")
    if per_example is None:
        rows = tf.reshape(value, [tf.shape(value)[0], -1])[:, :size]
        value = tf.pad(rows, [[0, 0], [0, size - tf.shape(rows)[1]]])
    if value.dtype.is_floating and spec.dtype.is_integer:
        value = tf.clip_by_value(tf.cast(value, tf.float64), *_integer_range(spec.dtype))
    return finite(tf.reshape(tf.cast(value, spec.dtype), [-1, *spec.shape]))


class RecordDecoder:
    """Serialized tf.Examples -> (model inputs, labels), optionally through a TransformGraph.
    The model inputs are the module's model_inputs (one float32 tensor), or, without it, the
    model's named Inputs `inputs` (declared_inputs: a dict of tensors, as_input; needed only
    to decode inputs)."""

    def __init__(self, module: UserModule, transform_output=None,
                 inputs: Optional[Mapping[str, tf.TensorSpec]] = None):
        self.module = module
        self.transform_output = transform_output
        if transform_output is None and module.feature_spec is None:
            raise ValueError("the module defines no feature_spec() and there is no "
                             "TransformGraph: one of them gives the raw features")
        raw_spec = (transform_output.raw_feature_spec() if transform_output is not None
                    else module.feature_spec())
        transformed = (transform_output.transformed_feature_spec()
                       if transform_output is not None else {})
        if module.label_key not in raw_spec and module.label_key not in transformed:
            raise ValueError(f"the label {module.label_key!r} is neither a raw feature "
                             f"{sorted(raw_spec)} nor a transformed one {sorted(transformed)}")
        check_spec(raw_spec)
        self.raw_spec = raw_spec
        # Labels and records alone (SLAedValidator) need no inputs.
        self.inputs = None if module.model_inputs is not None or inputs is None \
            else dict(inputs)
        # A raw label is absent at serving; a transformed one is computed from raw features
        # that a request may or may not hold (missing ones are read as their defaults).
        self.serving_spec = {k: v for k, v in raw_spec.items() if k != module.label_key}
        self.transform_layer = (transform_output.transform_features_layer()
                                if transform_output is not None else None)

    def _inputs(self, raw: dict) -> tuple:
        features = dict(raw)
        if self.transform_layer is not None:
            features = self.transform_layer(raw)
        if self.module.model_inputs is not None:
            return finite(tf.cast(self.module.model_inputs(features), tf.float32)), features
        if self.inputs is None:
            raise ValueError("the module defines no model_inputs(features), and the decoder "
                             "was not given the model's named Inputs (declared_inputs)")
        absent = sorted(set(self.inputs) - set(features))
        if absent:
            raise ValueError(f"the model's Inputs {absent} are not among the "
                             f"{'transformed ' if self.transform_layer is not None else ''}"
                             f"features {sorted(features)}: name each Input after the feature "
                             "it reads, or define model_inputs(features)")
        return {name: as_input(name, features[name], spec)
                for name, spec in self.inputs.items()}, features

    def _label(self, raw: dict, features: dict) -> tf.Tensor:
        return finite(tf.cast(features.get(self.module.label_key, raw.get(self.module.label_key)),
                              tf.float32))

    def sanitise(self, serialized) -> list[bytes]:
        """The records, each mapped to a valid record of the raw spec (record_rule)."""
        return sanitise_records(serialized, self.raw_spec)

    def _parse(self, sanitised) -> dict:
        """Records already sanitised (`sanitise`), parsed: never raises on a record's content."""
        return tf.io.parse_example(tf.constant(list(sanitised), tf.string), self.raw_spec)

    def decode(self, serialized: list[bytes]) -> tuple:
        """(inputs, labels), one row per record; 0 rows (of the spec's width) for no records.
        Every call decodes a null_record ahead of the records and drops it, so an empty split
        takes the same path as any other and the shapes never depend on the record count."""
        raw = self._parse(self.sanitise([null_record(self.raw_spec)] + list(serialized)))
        inputs, features = self._inputs(raw)
        return (tf.nest.map_structure(lambda tensor: tensor[1:], inputs),
                self._label(raw, features)[1:])

    def labels(self, sanitised) -> tf.Tensor:
        """The labels the model was trained on (transformed, when the transform outputs them), of
        records already sanitised (`sanitise`; the caller needs them for the model too)."""
        raw = self._parse(sanitised)
        features = self.transform_layer(raw) if self.transform_layer is not None else raw
        return self._label(raw, features)

    def serving_inputs(self, serialized: tf.Tensor):
        """The model inputs of serialized records in the serving signature: a feature missing, of another number of values than its spec, or
        non-finite is read as its default, as training read it (parse_with_defaults: one of
        another type fails the request)."""
        return self._inputs(parse_with_defaults(serialized, self.serving_spec))[0]

    def transformed_features(self, serialized: tf.Tensor) -> dict:
        """The transform's dense outputs of serialized raw records (the label too, when they
        hold it), read with the record rule's defaults as training read them (parse_with_defaults
        says which bad features it maps): the SavedModel's
        `transform_features` signature, which TFMA reads. A sparse or ragged output is left
        out: a signature returns tensors."""
        return {name: value for name, value in
                self.transform_layer(parse_with_defaults(serialized, self.raw_spec)).items()
                if isinstance(value, tf.Tensor)}
