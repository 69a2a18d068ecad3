"""ObliviousSampleGen executor: read the granted training records, sample them obliviously for
the requested epochs, and write the samples in training order with their descriptor."""
from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx.components.oblivious_sample_gen import samples_io
from sage_tfx.components.oblivious_sample_gen.descriptor import SCHEMES
from sage_tfx.components.oblivious_sample_gen.sampling import (samples_poisson, samples_swo,
                                                               shuffle_and_split)
from sage_tfx.components.privacy_grant import carry_grant, require_grant

TRAIN_SPLIT = "train"


def read_split(examples_uri: str, split: str) -> tf.Tensor:
    """Every serialized record of one split, as a string tensor."""
    files = sorted(glob.glob(os.path.join(examples_uri, f"Split-{split}", "*")))
    if not files:
        raise ValueError(f"the Examples at {examples_uri} have no {split!r} split files")
    batches = list(tf.data.TFRecordDataset(files, compression_type="GZIP").batch(65536))
    if not batches:
        raise ValueError(f"the {split!r} split of the Examples at {examples_uri} is empty")
    return tf.concat(batches, axis=0)


def sample(records: tf.Tensor, exec_properties: dict[str, Any]):
    scheme = exec_properties["scheme"]
    seed = exec_properties.get("seed")
    common = dict(seed=None if seed is None else int(seed),
                  epochs=int(exec_properties.get("epochs") or 1))
    if scheme == "poisson":
        gamma = exec_properties.get("gamma")
        if gamma is None:
            raise ValueError("scheme 'poisson' needs gamma")
        return samples_poisson(records, float(gamma), **common)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; use one of {SCHEMES}")
    sample_size = exec_properties.get("sample_size")
    if sample_size is None:
        raise ValueError(f"scheme {scheme!r} needs sample_size")
    sampler = samples_swo if scheme == "swo" else shuffle_and_split
    return sampler(records, int(sample_size), **common)


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        grant = require_grant(input_dict["grant"], input_dict["examples"])
        source = artifact_utils.get_single_instance(input_dict["examples"])
        key_variable = exec_properties.get("encryption_key_env")
        key = samples_io.key_from_env(key_variable) if key_variable else None

        samples = sample(read_split(source.uri, TRAIN_SPLIT), exec_properties)
        # Dummy slots carry a copy of some record after routing; blank them before writing.
        records = samples.records.numpy()
        records[samples.sample_ids == 0] = b""

        output = artifact_utils.get_single_instance(output_dict["samples"])
        output.split_names = artifact_utils.encode_split_names([TRAIN_SPLIT])
        width = samples_io.write_samples(os.path.join(output.uri, f"Split-{TRAIN_SPLIT}"),
                                         records, samples.sample_ids, samples.descriptor, key)
        for name, value in samples.descriptor.to_properties().items():
            if isinstance(value, int):
                output.set_int_custom_property(name, value)
            else:
                output.set_string_custom_property(name, value)
        output.set_int_custom_property("sampling_encrypted", int(key is not None))
        output.set_int_custom_property("sampling_record_width", width)
        carry_grant(grant, output, "ObliviousSampleGen")
        logging.info("ObliviousSampleGen: %s sampling, %d epoch(s), %s", samples.descriptor.scheme,
                     samples.descriptor.epochs, "encrypted" if key else "not encrypted")
