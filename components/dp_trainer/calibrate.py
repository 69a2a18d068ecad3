"""Noise calibration: the DP-SGD noise multiplier that spends exactly a given (epsilon, delta).

    python -m sage_tfx.components.dp_trainer.calibrate --scheme poisson|swo|shuffle --size N
           --batch B --epochs E --epsilon EPS --delta D [--json]

prints {"noise_multiplier", "steps", "epsilon"}: the smallest noise multiplier (to 1e-6) whose
accounted epsilon at D is at most EPS, for the steps that sampling scheme runs on data brought
to N rows with batch B (for Poisson, the expected batch: gamma = B / N) for E epochs. N is the
size ObliviousSampleGen samples from: a public bound or a DP count, never an exact count of
private data (oblivious_sample_gen/accounting.py).

The accounting is the sampling's own (oblivious_sample_gen/accounting.py: the DpEvent of what
ran, dp-accounting's RDP accountant, Poisson truncation and routing overflow reserved out of
delta), and the search is dp-accounting's `calibrate_dp_mechanism` (Brent's method on the
noise multiplier). The reserve is computed for epsilon <= EPS, so calibration targets
delta - truncation_delta(EPS) and the reported epsilon is checked against the cap EPS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass

import dp_accounting
from dp_accounting import mechanism_calibration, rdp

from sage_tfx.components.oblivious_sample_gen import accounting
from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor, Scheme
from sage_tfx.components.oblivious_sample_gen.sampling import plan
from sage_tfx.sage_access.errors import BadRequest

# Beyond this, the noise in an averaged gradient is so large (noise std / batch ~ sigma C / B)
# that training would only add noise; the trainer refuses instead of spending the grant.
DEFAULT_MAX_NOISE_MULTIPLIER = 100.0
_MIN_NOISE_MULTIPLIER = 1e-3


class CalibrationError(BadRequest):
    """The (epsilon, delta) cannot pay for the run within the allowed noise (public numbers
    only: a BadRequest, whose message the release protocol may record and show)."""


@dataclass(frozen=True)
class Calibration:
    noise_multiplier: float
    steps: int
    epsilon: float  # accounted epsilon at the calibrated noise (<= the target)


def calibrate(descriptor: SamplingDescriptor, epsilon: float, delta: float,
              max_noise_multiplier: float = DEFAULT_MAX_NOISE_MULTIPLIER) -> Calibration:
    """The noise multiplier for DP-SGD with this sampling that spends at most (epsilon, delta)."""
    if not epsilon > 0:
        raise CalibrationError(f"epsilon must be > 0, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise CalibrationError(f"DP-SGD's Gaussian noise needs delta in (0, 1), got {delta}")
    if descriptor.steps < 1:
        raise CalibrationError(f"the sampling runs no step ({descriptor})")
    target_delta = delta - accounting.truncation_delta(descriptor, epsilon)
    if target_delta < delta / 2.0:
        raise CalibrationError(f"delta={delta} is too small to cover Poisson truncation "
                               "and routing overflow")

    def accounted(noise_multiplier: float) -> float:
        return accounting.epsilon(descriptor, noise_multiplier, delta, epsilon_cap=epsilon)

    if accounting.rdp_epsilon(descriptor, max_noise_multiplier, target_delta) > epsilon:
        raise CalibrationError(
            f"(epsilon={epsilon:g}, delta={delta:g}) cannot pay for {descriptor.steps} DP-SGD "
            f"step(s) of {descriptor.scheme} sampling: even noise multiplier "
            f"{max_noise_multiplier:g} spends more. Ask the ledger for more budget or run fewer steps.")
    if accounting.rdp_epsilon(descriptor, _MIN_NOISE_MULTIPLIER, target_delta) <= epsilon:
        noise_multiplier = _MIN_NOISE_MULTIPLIER  # the budget exceeds what any useful noise spends
    else:
        noise_multiplier = mechanism_calibration.calibrate_dp_mechanism(
            lambda: rdp.RdpAccountant(list(accounting.RDP_ORDERS),
                                      accounting.neighboring_relation(descriptor)),
            lambda sigma: accounting.dp_event(descriptor, sigma),
            epsilon, target_delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(
                _MIN_NOISE_MULTIPLIER, max_noise_multiplier))
    return Calibration(float(noise_multiplier), descriptor.steps, accounted(noise_multiplier))


def plan_for_batch(scheme: str, size: int, batch: int, epochs: int) -> SamplingDescriptor:
    """The descriptor of `scheme` on `size` rows (public or DP) at batch size `batch`
    (Poisson: expected batch, sized from a DP count whose undershoot is accounted)."""
    if scheme == Scheme.POISSON:
        if not 0 < batch <= size:
            raise ValueError(f"batch {batch} must be in [1, size={size}]")
        return dataclasses.replace(
            plan(scheme, size, epochs, gamma=batch / size),
            size_truncation_probability=accounting.SIZE_TRUNCATION_PROBABILITY)
    return plan(scheme, size, epochs, sample_size=batch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sage_tfx.components.dp_trainer.calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=Scheme.values(), required=True)
    parser.add_argument("--size", type=int, required=True,
                        help="rows sampled from: a public bound or a DP count")
    parser.add_argument("--batch", type=int, required=True,
                        help="batch size (Poisson: expected batch size, gamma = batch / n)")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--epsilon", type=float, required=True)
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--max-noise-multiplier", type=float, default=DEFAULT_MAX_NOISE_MULTIPLIER)
    parser.add_argument("--json", action="store_true", help="JSON only (the default output too)")
    args = parser.parse_args(argv)
    try:
        descriptor = plan_for_batch(args.scheme, args.size, args.batch, args.epochs)
        result = calibrate(descriptor, args.epsilon, args.delta, args.max_noise_multiplier)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
