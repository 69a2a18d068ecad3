"""The user's module file, like TFX Trainer's `run_fn` module, and how records become tensors.

A module defines:
    LABEL_KEY = "trip_seconds"
    def feature_spec() -> dict[str, tf.io.FixedLenFeature]   # raw features, label included
    def model_inputs(features: dict[str, tf.Tensor]) -> tf.Tensor   # [batch, d] float32
    def build_model() -> tf.keras.Model   # dp_sgd: float32, each example on its own
    def loss() -> tf.keras.losses.Loss    # dp_sgd: per-example loss of the task
(DP-SGD refuses, before the charge, a model or loss that mixes the examples of a batch, keeps
state across steps or checks values: dp_trainer/stand_in.py.)
With a TransformGraph, records are parsed with its raw feature spec and transformed first;
`model_inputs` then receives the transformed features (the label is taken from them when
present, otherwise from the raw features).

Bad records (components/record_rule.py): the decoder sanitises every record before parsing
(missing, malformed or non-finite features become their public defaults) and maps non-finite
model inputs and labels to 0, so no record's content can make a DP component raise or train on
NaN after its grant was charged. Serving applies the same `finite` map to model inputs.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import tensorflow as tf

from sage_tfx.components.record_rule import (check_spec, finite, null_record,
                                              parse_with_defaults, sanitise_records)

# What every use of a module needs; each component adds what its mode or metric needs
# (dp_trainer.parameters.MODULE_NEEDS, validators.executor.MODULE_NEEDS).
ALWAYS_NEEDED = ("LABEL_KEY", "feature_spec")
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


@dataclass(frozen=True)
class UserModule:
    label_key: str
    feature_spec: Callable[[], dict]
    model_inputs: Optional[Callable[[dict], tf.Tensor]]
    build_model: Optional[Callable[[], tf.keras.Model]]
    loss: Optional[Callable[[], tf.keras.losses.Loss]]

    @classmethod
    def load(cls, path: str, purpose: str, needs: Sequence[str] = ()) -> "UserModule":
        """The module at `path`; ValueError if it lacks what `purpose` `needs` (beyond
        ALWAYS_NEEDED)."""
        module = import_module_file(path)
        missing = [name for name in (*ALWAYS_NEEDED, *needs) if not hasattr(module, name)]
        if missing:
            raise ValueError(f"module file {path} lacks {missing} (needed for {str(purpose)!r})")
        return cls(module.LABEL_KEY, module.feature_spec, getattr(module, "model_inputs", None),
                   getattr(module, "build_model", None), getattr(module, "loss", None))


class RecordDecoder:
    """Serialized tf.Examples -> (model inputs, labels), optionally through a TransformGraph."""

    def __init__(self, module: UserModule, transform_output=None):
        self.module = module
        self.transform_output = transform_output
        raw_spec = (transform_output.raw_feature_spec() if transform_output is not None
                    else module.feature_spec())
        if module.label_key not in raw_spec:
            raise ValueError(f"the feature spec has no label {module.label_key!r}")
        check_spec(raw_spec)
        self.raw_spec = raw_spec
        self.serving_spec = {k: v for k, v in raw_spec.items() if k != module.label_key}
        self.transform_layer = (transform_output.transform_features_layer()
                                if transform_output is not None else None)

    def _inputs(self, raw: dict) -> tuple[tf.Tensor, dict]:
        features = dict(raw)
        if self.transform_layer is not None:
            features = self.transform_layer(raw)
        return finite(tf.cast(self.module.model_inputs(features), tf.float32)), features

    def _label(self, raw: dict, features: dict) -> tf.Tensor:
        return finite(tf.cast(features.get(self.module.label_key, raw[self.module.label_key]),
                              tf.float32))

    def sanitise(self, serialized) -> list[bytes]:
        """The records, each mapped to a valid record of the raw spec (record_rule)."""
        return sanitise_records(serialized, self.raw_spec)

    def _parse(self, sanitised) -> dict:
        """Records already sanitised (`sanitise`), parsed: never raises on a record's content."""
        return tf.io.parse_example(tf.constant(list(sanitised), tf.string), self.raw_spec)

    def decode(self, serialized: list[bytes]) -> tuple[tf.Tensor, tf.Tensor]:
        """(inputs, labels), one row per record; 0 rows (of the spec's width) for no records.
        Every call decodes a null_record ahead of the records and drops it, so an empty split
        takes the same path as any other and the shapes never depend on the record count."""
        raw = self._parse(self.sanitise([null_record(self.raw_spec)] + list(serialized)))
        inputs, features = self._inputs(raw)
        return inputs[1:], self._label(raw, features)[1:]

    def labels(self, sanitised) -> tf.Tensor:
        """The labels the model was trained on (transformed, when the transform outputs them), of
        records already sanitised (`sanitise`; the caller needs them for the model too)."""
        raw = self._parse(sanitised)
        features = self.transform_layer(raw) if self.transform_layer is not None else raw
        return self._label(raw, features)

    def serving_inputs(self, serialized: tf.Tensor) -> tf.Tensor:
        """The model inputs of serialized records in the serving signature: a record missing a
        feature (or with a non-finite value) is read with its default, as training read it."""
        return self._inputs(parse_with_defaults(serialized, self.serving_spec))[0]
