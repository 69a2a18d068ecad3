"""ObliviousSampleGen executor: read the granted training records, sample them obliviously for
the requested epochs, and write the samples in training order with their descriptor."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import numpy as np
import tensorflow as tf
from tfx.dsl.components.base import base_executor
from tfx.types import artifact_utils

from sage_tfx import console
from sage_tfx.components.oblivious_sample_gen import accounting, samples_io
from sage_tfx.components.oblivious_sample_gen import constants as sample_keys
from sage_tfx.components.oblivious_sample_gen.descriptor import Scheme
from sage_tfx.components.oblivious_sample_gen.sampling import (DEFAULT_EPOCHS, samples_poisson,
                                                               samples_swo, shuffle_and_split)
from sage_tfx.components.privacy_grant import carry_grant, require_grant
from sage_tfx.release import GuaranteeUnit
from sage_tfx.components.util.examples_io import TRAIN_SPLIT, read_split
from sage_tfx.mechanisms import discrete_laplace
from sage_tfx.private_files import private_directory
from sage_tfx.sage_access.accounting import pure_dp_event

def dp_count(n: int, epsilon: float) -> int:
    """n + DiscreteLaplace(1 / epsilon) (sensitivity 1 under add/remove), from the platform's
    one noise module (OS CSPRNG, no seed)."""
    return int(np.asarray(discrete_laplace([n], l1_sensitivity=1, epsilon=epsilon).value)[0])


def sampled_size(records: tf.Tensor, grant, exec_properties: dict[str, Any]) -> tuple[int, float]:
    """(N, tau): the public size the records are brought to (accounting.sized_for), from the
    user's `public_size` (SWO/shuffle only) or a DP count paid by the grant's COUNT_STEP share.
    Only the count n_hat is released; the exact n decides nothing else. n_hat may be <= 0
    (an empty or small split plus negative noise): sized_for clamps it to the smallest valid
    public size, a function of n_hat and public parameters only, so post-processing."""
    scheme = Scheme.parse(exec_properties["scheme"], "scheme")
    public_size = exec_properties.get("public_size")
    if public_size is not None:
        if scheme == Scheme.POISSON:
            raise ValueError("scheme 'poisson' sizes its layout from a DP count; drop public_size "
                             f"and give the grant a {accounting.COUNT_STEP!r} share")
        return int(public_size), 0.0
    count_epsilon, _ = grant.share(accounting.COUNT_STEP)
    # The count is epsilon-DP (discrete Laplace): what the ledger recorded must say so.
    grant.check_event(accounting.COUNT_STEP, pure_dp_event(count_epsilon))
    n_hat = dp_count(int(records.shape[0]), count_epsilon)
    return accounting.sized_for(scheme, n_hat, count_epsilon, exec_properties.get("sample_size"))


def sample(records: tf.Tensor, exec_properties: dict[str, Any], size: int):
    scheme = Scheme.parse(exec_properties["scheme"], "scheme")
    seed = exec_properties.get("seed")
    common = dict(seed=None if seed is None else int(seed),
                  epochs=int(exec_properties.get("epochs") or DEFAULT_EPOCHS), size=size)
    if scheme == Scheme.POISSON:
        gamma = exec_properties.get("gamma")
        if gamma is None:
            raise ValueError("scheme 'poisson' needs gamma")
        return samples_poisson(records, float(gamma), **common)
    sample_size = exec_properties.get("sample_size")
    if sample_size is None:
        raise ValueError(f"scheme {scheme.value!r} needs sample_size")
    sampler = samples_swo if scheme == Scheme.SWO else shuffle_and_split
    return sampler(records, int(sample_size), **common)


class Executor(base_executor.BaseExecutor):

    def Do(self, input_dict: dict[str, list], output_dict: dict[str, list],
           exec_properties: dict[str, Any]) -> None:
        grant = require_grant(input_dict["grant"], input_dict["examples"])
        grant.refuse_fixed_seed("ObliviousSampleGen", exec_properties.get("seed"))
        source = artifact_utils.get_single_instance(input_dict["examples"])
        key_variable = exec_properties.get("encryption_key_env")
        key = samples_io.key_from_env(key_variable) if key_variable else None
        record_width = exec_properties.get("record_width")
        if key is not None and not record_width:
            raise ValueError("encrypted samples need record_width, the public byte width every "
                             "serialized record is padded to")

        records = read_split(source.uri, TRAIN_SPLIT)
        size, size_truncation = sampled_size(records, grant, exec_properties)
        # With a DP count the sampler spends the count step's share: its outcome is recorded.
        counted = exec_properties.get("public_size") is None
        with grant.releasing(accounting.COUNT_STEP, "ObliviousSampleGen component") if counted \
                else contextlib.nullcontext() as charged:
            samples = sample(records, exec_properties, size)
            descriptor = dataclasses.replace(samples.descriptor,
                                             size_truncation_probability=size_truncation)
            # Null and dummy slots hold null records (b""): routing copies no record into them.
            records = samples.records

            output = artifact_utils.get_single_instance(output_dict["samples"])
            output.split_names = artifact_utils.encode_split_names([TRAIN_SPLIT])
            private_directory(output.uri)  # the sampled records: private (private_files.py)
            samples_io.write_samples(os.path.join(output.uri, f"Split-{TRAIN_SPLIT}"), records,
                                     samples.sample_ids, descriptor, key,
                                     int(record_width) if key is not None else 0)
            for name, value in descriptor.to_properties().items():
                if isinstance(value, int):
                    output.set_int_custom_property(name, value)
                else:
                    output.set_string_custom_property(name, value)
            output.set_int_custom_property(sample_keys.ENCRYPTED, int(key is not None))
            if key is not None:
                output.set_int_custom_property(sample_keys.RECORD_WIDTH, int(record_width))
            carry_grant(grant, output, "ObliviousSampleGen")
            # n is the DP count (or the user's public size), never the exact number of records.
            console.report("ObliviousSampleGen: %s sampling of %d rows (%s), %d epoch(s), %s",
                           descriptor.scheme, descriptor.n,
                           "public size" if exec_properties.get("public_size") is not None
                           else "DP count", descriptor.epochs,
                           "encrypted" if key else "not encrypted")
            if counted:  # the DP count (n in the descriptor) is released; the samples are not
                count_epsilon, _ = grant.record.share(accounting.COUNT_STEP)
                charged.released([], charged.guarantee(GuaranteeUnit.RECORD,
                                                       epsilon=count_epsilon, delta=0.0))
