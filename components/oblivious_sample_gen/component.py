"""ObliviousSampleGen component: a whole run's minibatches, sampled obliviously."""
from __future__ import annotations

from typing import Optional

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.oblivious_sample_gen import executor
from sage_tfx.components.oblivious_sample_gen.descriptor import SCHEMES
from sage_tfx.components.privacy_grant import PrivacyGrant


class ObliviousSampleGenSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "scheme": component_spec.ExecutionParameter(type=str),
        "sample_size": component_spec.ExecutionParameter(type=int, optional=True),
        "gamma": component_spec.ExecutionParameter(type=float, optional=True),
        "epochs": component_spec.ExecutionParameter(type=int),
        "encryption_key_env": component_spec.ExecutionParameter(type=str, optional=True),
        "seed": component_spec.ExecutionParameter(type=int, optional=True),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=standard_artifacts.Examples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
    }
    OUTPUTS = {
        "samples": component_spec.ChannelParameter(type=standard_artifacts.Examples),
    }


class ObliviousSampleGen(base_component.BaseComponent):
    """Samples the granted training split for `epochs` epochs with `scheme`:
    'swo' (k = n // sample_size samples without replacement per epoch), 'poisson' (rate
    gamma, floor(1/gamma) samples per epoch) or 'shuffle' (the non-oblivious baseline).

    Output: Examples whose train split holds the samples in training order, with the sampling
    descriptor as custom properties (`sampling_*`) for the trainer's accountant. With
    `encryption_key_env` (the name of an environment variable holding a base64 AES-256 key),
    the samples are stored AES-GCM encrypted. Randomness comes from the OS CSPRNG; `seed` exists
    for tests only.
    """

    SPEC_CLASS = ObliviousSampleGenSpec
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, scheme: str,
                 sample_size: Optional[int] = None, gamma: Optional[float] = None,
                 epochs: int = 1, encryption_key_env: Optional[str] = None,
                 seed: Optional[int] = None):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; use one of {SCHEMES}")
        if (gamma is None) == (scheme == "poisson") or (sample_size is None) == (scheme != "poisson"):
            raise ValueError("give gamma for scheme 'poisson' and sample_size for 'swo'/'shuffle'")
        super().__init__(spec=ObliviousSampleGenSpec(
            scheme=scheme, sample_size=sample_size, gamma=gamma, epochs=epochs,
            encryption_key_env=encryption_key_env, seed=seed, examples=examples, grant=grant,
            samples=channel.Channel(type=standard_artifacts.Examples)))
