"""The privacy-adaptive driver's policies (Sage §3.3): what to ask for after a RETRY.

The driver (adaptive.py) and the workload simulator (benchmarks/workload_sim.py) both follow
these rules; neither restates them.
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Callable, Mapping, Optional

from sage_tfx.choices import Choice
from sage_tfx.sage_access.errors import BadRequest


class PolicyName(Choice):
    """conserve: the least budget first, doubling epsilon while the allocation can pay it;
    aggressive: all the budget it may draw on the window at once."""
    CONSERVE = "conserve"
    AGGRESSIVE = "aggressive"


@dataclass(frozen=True)
class Policy:
    name: str = PolicyName.CONSERVE
    initial_epsilon: float = 0.125
    min_window: int = 1
    max_iterations: int = 10
    # The fraction of an iteration's training share that DPTuner gets when the iteration tunes
    # (0: never tune); see tune_next for when it does.
    tuning_share: float = 0.0

    def check(self) -> None:
        try:
            PolicyName.parse(self.name, "policy")
        except ValueError as error:
            raise BadRequest(str(error)) from None
        if not self.initial_epsilon > 0:
            raise BadRequest(f"initial_epsilon must be positive, got {self.initial_epsilon}")
        if not (isinstance(self.min_window, int) and self.min_window >= 1):
            raise BadRequest(f"min_window must be a positive integer, got {self.min_window!r}")
        if self.max_iterations < 1:
            raise BadRequest(f"max_iterations must be >= 1, got {self.max_iterations}")
        if not 0.0 <= self.tuning_share < 1.0:
            raise BadRequest(f"tuning_share must lie in [0, 1), got {self.tuning_share}")


@dataclass(frozen=True)
class Tuned:
    """What an iteration that tuned released: DPTuner's best setting and its DP score, and the
    validator's DP metric of the model trained with it, with its interval."""
    setting: Mapping[str, float]
    dp_score: float
    dp_metric: float
    lower_bound: float
    upper_bound: float


def tune_next(tuning_share: float, last_iteration_tuned: Optional[Tuned],
              tuned_before: bool, higher_is_better: bool) -> bool:
    """Whether the next iteration tunes (it gives `tuning_share` of its training share to
    DPTuner), from the DP values released so far only:

    * never with tuning_share 0; the first iteration tunes (nothing is known yet);
    * the released best setting is public: later iterations train with it at no cost, and the
      tuning share goes back to training. Tuning pays for its share only while that setting is
      in doubt: the next iteration tunes again when the last one tuned and its trained model's
      DP metric fell short of the tuner's DP score for the setting by more than the validator's
      half interval (the setting did not deliver on the training data what it scored on the
      held-out share; e.g. more epsilon or data now favours another learning rate); otherwise
      (confirmed, or carried from an earlier iteration) it does not.
    A heuristic, not a guarantee: every choice is a function of DP releases, so the run's
    privacy is the ledger's whatever it chooses."""
    if tuning_share <= 0:
        return False
    if not tuned_before:
        return True
    if last_iteration_tuned is None:
        return False
    last = last_iteration_tuned
    shortfall = (last.dp_score - last.dp_metric if higher_is_better
                 else last.dp_metric - last.dp_score)
    return shortfall > (last.upper_bound - last.lower_bound) / 2.0


def split_with_tuning(split: Mapping[str, object], tuning_share: float,
                      step: str = "tuning", from_step: str = "training") -> dict[str, str]:
    """`split` with `tuning_share` of `from_step`'s fraction moved to `step`, in exact
    decimals (the ledger's check_split sums them exactly: the total does not move)."""
    whole = Decimal(str(split[from_step]))
    tuning = whole * Decimal(repr(float(tuning_share)))
    return {**{name: str(fraction) for name, fraction in split.items()},
            from_step: str(whole - tuning), step: str(tuning)}


def after_retry(policy: str, epsilon: float, window: int,
                blocks_payable_at: Callable[[float], int]) -> tuple[float, int]:
    """(epsilon, window) of the next iteration after a RETRY at `epsilon` on `window` blocks.
    conserve doubles epsilon if the pipeline's allocation can pay twice it on as many blocks
    (`blocks_payable_at(2 epsilon)` >= window), otherwise doubles the window; aggressive always
    doubles the window (it draws all it may on it). Either way the next iteration has twice the
    resources, epsilon x blocks, which bounds the failed iterations' cost by the accepted one's."""
    if PolicyName.parse(policy, "policy") == PolicyName.CONSERVE and \
            blocks_payable_at(2 * epsilon) >= window:
        return 2 * epsilon, window
    return epsilon, 2 * window
