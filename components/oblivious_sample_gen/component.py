"""ObliviousSampleGen component: a whole run's minibatches, sampled obliviously."""
from __future__ import annotations

from typing import Optional

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec

from sage_tfx.components.block_ledger.component import refuse_seed_before_charge
from sage_tfx.components.dag_guard import PrivateExamples, ProducesPrivateRecords
from sage_tfx.components.oblivious_sample_gen import executor
from sage_tfx.components.oblivious_sample_gen.descriptor import Scheme
from sage_tfx.components.oblivious_sample_gen.sampling import DEFAULT_EPOCHS
from sage_tfx.components.privacy_grant import PrivacyGrant


class ObliviousSampleGenSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "scheme": component_spec.ExecutionParameter(type=str),
        "sample_size": component_spec.ExecutionParameter(type=int, optional=True),
        "gamma": component_spec.ExecutionParameter(type=float, optional=True),
        "epochs": component_spec.ExecutionParameter(type=int),
        "encryption_key_env": component_spec.ExecutionParameter(type=str, optional=True),
        "seed": component_spec.ExecutionParameter(type=int, optional=True),
        "public_size": component_spec.ExecutionParameter(type=int, optional=True),
        "record_width": component_spec.ExecutionParameter(type=int, optional=True),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }
    OUTPUTS = {
        "samples": component_spec.ChannelParameter(type=PrivateExamples),
    }


class ObliviousSampleGen(ProducesPrivateRecords, base_component.BaseComponent):
    """Samples the granted training split for `epochs` epochs with `scheme`:
    'swo' (k = n // sample_size samples without replacement per epoch), 'poisson' (rate
    gamma, floor(1/gamma) samples per epoch) or 'shuffle' (the non-oblivious baseline).

    Size: the data is padded with null records or cut to a uniformly random subset of N rows,
    where N is `public_size` (a public bound the user declares; 'swo'/'shuffle' only) or comes
    from a DP count of the records paid by the grant's "sampling_count" share
    (accounting.py has the derivation). No exact count is stored or logged.

    Output: Examples whose train split holds the samples in training order, with the sampling
    descriptor as custom properties (`sampling_*`) for the trainer's accountant. With
    `encryption_key_env` (the name of an environment variable holding a base64 AES-256 key),
    the samples are stored AES-GCM encrypted, each serialized record padded to `record_width`
    bytes (public, declared by the user); a record longer than that is dropped (replaced by a
    null record), which the add/remove relation allows. Randomness comes from the OS CSPRNG; `seed` exists
    for tests only: it is refused, before the charge, on a ledger not created for tests
    (BlockLedger.create(..., for_tests=True)).
    """

    SPEC_CLASS = ObliviousSampleGenSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, scheme: str,
                 sample_size: Optional[int] = None, gamma: Optional[float] = None,
                 epochs: int = DEFAULT_EPOCHS, encryption_key_env: Optional[str] = None,
                 seed: Optional[int] = None, public_size: Optional[int] = None,
                 record_width: Optional[int] = None):
        scheme = Scheme.parse(scheme, "scheme")
        poisson = scheme == Scheme.POISSON
        if (gamma is None) == poisson or (sample_size is None) == (not poisson):
            raise ValueError("give gamma for scheme 'poisson' and sample_size for 'swo'/'shuffle'")
        if public_size is not None and (poisson or public_size < sample_size):
            raise ValueError(f"public_size={public_size} needs scheme 'swo' or 'shuffle' and at "
                             f"least sample_size={sample_size} rows")
        if (encryption_key_env is None) != (record_width is None) or (record_width or 1) < 1:
            raise ValueError("encrypted samples need a positive record_width (the public byte "
                             "width of a serialized record), and only they take one")
        super().__init__(spec=ObliviousSampleGenSpec(
            scheme=scheme, sample_size=sample_size, gamma=gamma, epochs=epochs,
            encryption_key_env=encryption_key_env, seed=seed, public_size=public_size,
            record_width=record_width, examples=examples, grant=grant,
            samples=channel.Channel(type=PrivateExamples)))
        if seed is not None:
            refuse_seed_before_charge(grant, f"ObliviousSampleGen seed {seed}")
