"""DPTrainer's parameters and the checks it can make before its grant is charged.

The component, the executor and the privacy-adaptive driver take the trainer's modes and
defaults from here, and the driver asks `preflight` instead of restating the trainer's rules.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from sage_tfx.choices import Choice
from sage_tfx.components.dp_trainer.calibrate import (DEFAULT_MAX_NOISE_MULTIPLIER, Calibration,
                                                      calibrate)
from sage_tfx.components.oblivious_sample_gen import accounting
from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor, Scheme
from sage_tfx.components.oblivious_sample_gen.sampling import DEFAULT_EPOCHS, plan
from sage_tfx.components.util.user_module import DEFAULT_MODEL_FN, raw_spec_needs
from sage_tfx.sage_access.accounting import split_share


class TrainerMode(Choice):
    """DP-SGD on ObliviousSampleGen's samples, or AdaSSP linear regression on the Examples."""
    DP_SGD = "dp_sgd"
    ADASSP = "adassp"


DEFAULT_MODE = TrainerMode.DP_SGD
# What each mode needs of the user's module (beyond user_module.ALWAYS_NEEDED and its raw
# features, module_needs): DP-SGD's model builder (named by model_fn) and, without
# model_inputs, the model's named Inputs and, without loss(), its compiled loss; AdaSSP a
# matrix of inputs.
MODULE_NEEDS = {TrainerMode.DP_SGD: (DEFAULT_MODEL_FN,),
                TrainerMode.ADASSP: ("model_inputs",)}


def module_needs(mode: TrainerMode, transform_graph: bool) -> tuple[str, ...]:
    """What DPTrainer in `mode` needs of its module, with or without a TransformGraph."""
    return (*MODULE_NEEDS[mode], *raw_spec_needs(transform_graph))
# DP-SGD's settings a HyperParameters artifact may set (DPTuner tunes them): public, and
# neither moves DP-SGD's privacy event (the noise is sigma * C: the clip norm scales signal and
# noise alike).
TUNABLE = ("learning_rate", "l2_norm_clip")
DEFAULT_GRANT_STEP = "training"  # the step of the grant's split that pays for training

# Poisson sampling's steps and accounting depend on gamma and the epochs only (sampling.py,
# poisson_layout: k = floor(1/gamma) samples per epoch whatever n is): `preflight` plans them on
# this stand-in size, which the calibration never reads.
POISSON_STAND_IN_N = 1_000


def calibrate_run(samples: SamplingDescriptor, epochs: Optional[int], epsilon: float,
                  delta: float, max_noise_multiplier: Optional[float] = None
                  ) -> tuple[SamplingDescriptor, Calibration]:
    """What DP-SGD runs on `samples`: their first `epochs` epochs (default: all of them), and
    its noise calibrated to (epsilon, delta). ValueError for epochs the samples do not hold,
    CalibrationError when (epsilon, delta) cannot pay for the run."""
    epochs = int(epochs or samples.epochs)
    if not 1 <= epochs <= samples.epochs:
        raise ValueError(f"epochs={epochs}: the samples hold {samples.epochs} epoch(s)")
    run = dataclasses.replace(samples, epochs=epochs)
    return run, calibrate(run, epsilon, delta,
                          float(max_noise_multiplier or DEFAULT_MAX_NOISE_MULTIPLIER))


def trains_with_dp_sgd(trainer: Mapping) -> bool:
    """Whether DPTrainer's parameters `trainer` choose DP-SGD (the default mode)."""
    return TrainerMode.parse(trainer.get("mode") or DEFAULT_MODE,
                             "trainer mode") == TrainerMode.DP_SGD


def preflight(trainer: Mapping, sampling: Optional[Mapping], epsilon: float, delta: float,
              split: Mapping[str, float]) -> None:
    """Raise, before a grant of (epsilon, delta) with `split` is charged, the error DPTrainer
    (keyword arguments `trainer`, training on ObliviousSampleGen's with `sampling`) would raise
    after it, where public values decide it.

    That is DP-SGD's calibration under Poisson sampling, whose steps (epochs x floor(1/gamma))
    and accounting do not depend on the number of records. For SWO and shuffling the steps
    depend on the data's size, which nobody may read before the grant: the trainer calibrates
    them on a size the grant pays for. AdaSSP's noise always fits its share."""
    if not trains_with_dp_sgd(trainer) or sampling is None:
        return
    if Scheme.parse(sampling.get("scheme"), "scheme") != Scheme.POISSON:
        return
    share_epsilon, share_delta = split_share(epsilon, delta, split,
                                             trainer.get("grant_step") or DEFAULT_GRANT_STEP)
    # ObliviousSampleGen sizes Poisson samples from a DP count (it refuses a public size), so
    # their descriptor carries the count's truncation probability (accounting.sized_for).
    samples = dataclasses.replace(
        plan(Scheme.POISSON, POISSON_STAND_IN_N, sampling.get("epochs") or DEFAULT_EPOCHS,
             gamma=sampling.get("gamma")),
        size_truncation_probability=accounting.SIZE_TRUNCATION_PROBABILITY)
    calibrate_run(samples, trainer.get("epochs"), share_epsilon, share_delta,
                  trainer.get("max_noise_multiplier"))
