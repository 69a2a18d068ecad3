"""A block's budget state and Sage's allocation policy (§3.3), as pure functions.

Nothing here touches storage: the ledger reads `BlockState`s, applies these functions and writes
the results back in one transaction. That keeps the rules testable on their own.

The policy:
* When a block arrives, its capacity is split evenly among the pipelines waiting at that time and
  reserved for them; with nobody waiting, all of it is free.
* A share must pay the stream's minimum request, or nobody could spend it. With more pipelines
  waiting than that allows (over 100 at the default minimum 0.01), the split goes to the ones
  that have waited longest. Sage splits among all of them; under overload that hands every
  waiting pipeline a share too small to spend on every new block, nobody is released again and
  the queue only grows (the workload simulator, benchmarks/workload_sim.py, showed it: 97% of the
  pipelines never released at 1.2 arrivals per hour under the taxi curve).
* A waiting pipeline draws on its reservation first, then on the block's free budget
  (capacity - spent - sum of the remaining reservations); any other grant (no pipeline, or a
  pipeline that is not waiting) draws on the free budget only. Nobody draws on another
  pipeline's reservation.
* When a pipeline is accepted or abandoned, its unused reservation returns and is re-split evenly
  among the pipelines still waiting (or becomes free when none is). A re-split share is added to
  what its pipeline may already hold on the block, so it needs no floor; the split of a new
  block is the only place where Sage's rule stops the platform.
* Whatever the policy says, a charge is admitted only if the block's own accounting still fits:
  the reservations are a fairness policy, the block's ceiling is the privacy guarantee.
* After a charge, a block that cannot pay the stream's minimum request is retired for good.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import numpy as np

# Budget vectors are exact fractions (accounting.py, exact.exact_vector): the constants below are
# ints, never floats, so that no arithmetic here rounds.


@dataclass(frozen=True)
class BlockState:
    block_id: str
    epsilon_ceiling: float
    delta_ceiling: float
    capacity: np.ndarray
    spent: np.ndarray
    # Remaining reserved budget of each waiting pipeline that holds a reservation on this block.
    reservations: Mapping[str, np.ndarray] = field(default_factory=dict)
    retired: bool = False
    charges: int = 0
    start: Optional[str] = None
    end: Optional[str] = None
    data_uri: Optional[str] = None
    data_format: Optional[str] = None   # ledger.DATA_FORMATS

    @functools.cached_property
    def reserved(self) -> np.ndarray:
        """The sum of the remaining (non-negative parts of the) reservations. Summed once per
        state: a window's planning asks it of every live block for every waiting pipeline, and
        fraction sums are what those questions cost. A state is never changed in place (`replace`
        makes a new one), so the sum stays right."""
        return sum((np.maximum(r, 0) for r in self.reservations.values()),
                   np.zeros_like(self.capacity))

    @functools.cached_property
    def free(self) -> np.ndarray:
        """What nobody holds: capacity - spent - the reservations (allocation.free_budget)."""
        return self.capacity - self.spent - self.reserved


def recipients(waiting: Sequence[str], budget: np.ndarray, min_demand: np.ndarray,
               accounting) -> list[str]:
    """Who shares `budget` evenly: the longest-waiting pipelines (`waiting` is in arrival
    order), as many as can each get a share that pays the minimum request (exactly: a share of
    exactly the minimum pays it)."""
    zero = np.zeros_like(budget)
    count = len(waiting)
    while count and not accounting.fits(zero, min_demand, budget / count):
        count -= 1
    return list(waiting[:count])


def new_block(block_id: str, epsilon_ceiling: float, delta_ceiling: float, capacity: np.ndarray,
              zero: np.ndarray, waiting: Sequence[str], min_demand: np.ndarray, accounting,
              start: Optional[str] = None, end: Optional[str] = None,
              data_uri: Optional[str] = None, data_format: Optional[str] = None) -> BlockState:
    sharing = recipients(waiting, capacity, min_demand, accounting)
    return BlockState(block_id=block_id, epsilon_ceiling=epsilon_ceiling,
                      delta_ceiling=delta_ceiling, capacity=capacity, spent=zero.copy(),
                      reservations={name: capacity / len(sharing) for name in sharing},
                      start=start, end=end, data_uri=data_uri,
                      data_format=data_format)


def _reserved_for_others(block: BlockState, pipeline: Optional[str]) -> np.ndarray:
    # Exact (fractions): the total less the pipeline's own part is the sum over the others.
    if pipeline in block.reservations:
        return block.reserved - np.maximum(block.reservations[pipeline], 0)
    return block.reserved


def free_budget(block: BlockState) -> np.ndarray:
    return block.free


def available_to(block: BlockState, pipeline: Optional[str]) -> np.ndarray:
    """What `pipeline` may still draw: its own reservation plus the free budget."""
    if pipeline in block.reservations:
        return block.free + np.maximum(block.reservations[pipeline], 0)
    return block.free


def can_pay(block: BlockState, demand: np.ndarray, pipeline: Optional[str], accounting) -> bool:
    # One exact comparison, `spent + others' reservations + demand <= capacity`, the same test
    # as the retirement test in `charge`: a block that passes the retirement test can pay the
    # minimum request, and one that cannot is retired (a block is never neither).
    if block.retired:
        return False
    return accounting.fits(block.spent + _reserved_for_others(block, pipeline), demand,
                           block.capacity)


def charge(block: BlockState, demand: np.ndarray, pipeline: Optional[str], accounting,
           min_demand: np.ndarray) -> BlockState:
    """The block after paying `demand`; the caller has checked `can_pay`."""
    reservations = dict(block.reservations)
    if pipeline is not None and pipeline in reservations:
        # Take from the reservation first; what it cannot cover comes out of the free budget
        # (which shrinks by itself as `spent` grows).
        reserved = reservations[pipeline]
        reservations[pipeline] = reserved - np.minimum(demand, np.maximum(reserved, 0))
    spent = block.spent + demand
    retired = not accounting.fits(spent, min_demand, block.capacity)
    return replace(block, spent=spent, reservations=reservations, retired=retired,
                   charges=block.charges + 1)


def release(block: BlockState, pipeline: str, still_waiting: Sequence[str]) -> BlockState:
    """Return `pipeline`'s unused reservation and re-split it among `still_waiting`."""
    if pipeline not in block.reservations:
        return block
    reservations = dict(block.reservations)
    returned = np.maximum(reservations.pop(pipeline), 0)
    others = [name for name in still_waiting if name != pipeline]
    if others and not block.retired:
        share = returned / len(others)
        for name in others:
            reservations[name] = reservations.get(name, np.zeros_like(share)) + share
    return replace(block, reservations=reservations)
