"""The privacy-adaptive driver's policies (Sage §3.3): what to ask for after a RETRY.

The driver (adaptive.py) and the workload simulator (benchmarks/workload_sim.py) both follow
these rules; neither restates them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
