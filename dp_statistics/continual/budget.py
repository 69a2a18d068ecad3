"""The budget of one window's continual release: noise scales, thresholds and the ledger charge.

Neighbouring streams differ by all records of one unit within the window's blocks; trigger times
are public (paper Def. 2.1). Noise is Gaussian on binary trees (tree.py); the accounting is zCDP
through dp-accounting's RDP accountant.

Key selection (Algorithm 2). A unit adds 1 to one leaf of at most C (key, round) trees: it has at
most C records and counts once per (key, round). A leaf lies in H = ceil(log2(T + 1)) nodes, so
with node noise sigma_s the selection trees are rho_s-zCDP, rho_s = C H / (2 sigma_s^2):
SelfComposedDpEvent(SingleEpochTreeAggregationDpEvent(sigma_s, T), C).

Values (Algorithm 3). Each of the unit's <= C records, |v| <= L, lands in exactly one leaf of one
key's value tree (the leaf of the step its key is next released); per level the unit changes the
node vector by at most C L in L2, so rho_v = H (C L)^2 / (2 sigma_v^2):
SingleEpochTreeAggregationDpEvent(sigma_v / (C L), T). Which leaf a record lands in depends only
on earlier outputs, and every unit's total rho is bounded on every transcript, so adaptive
composition applies; Honaker estimates, thresholds, predictions and rounding are post-processing.

Thresholding (paper Thm 3.1, adapted). Let A' be the operator with a round-1 selection tree for
every key of the universe from step 1. Ours differs from A' only when an affected key's round-1
tree crosses its threshold before the key first appears (every later round is followed from its
start, by prediction, in both). A unit affects at most C keys; tau_l = lambda_l * z with
P(Z(l) > tau_l) = beta / T, so by a union over the T leaves each such event has probability
<= beta. The coupling gives (eps, delta_conv + (e^eps + 1) C beta)-DP, eps the composed RDP's
epsilon at delta_conv.

Split (the paper's §5: selection eps/2 and 2 delta/3 including beta, values eps/2 and delta/3):
rho is split `selection_share` : 1 - `selection_share` between the two, the pair is calibrated to
(eps, delta_conv = 2 delta / 3) with dp-accounting, and (e^eps + 1) C beta = delta / 3 is the
grant's `additional_delta` (outside any DpEvent, like issue 18's partition selection).

The square-root factorization (factorization.py, issue 34) instead of the trees: the same two
running sums as B' (C' x + z) with B' the BLT decoder column-normalised over the window and
C' = B'^{-1} A, every column of norm s (factorization.py, "Column normalisation").
Selection: one step per (key, round) stream, k = 1 per stream over the unit's <= C streams:
SelfComposedDpEvent(GaussianDpEvent(sigma_s / s), C). Values: a unit's <= C records
may share a step, so its change is in the l1 ball of radius C L and the sensitivity is C L s
(factorization.py, "Sensitivity"): GaussianDpEvent(sigma_v / (C L s)). GaussianDpEvent holds
under every neighbouring relation the accountant knows. Thresholds keep tau_l = lambda_l
Phi^{-1}(1 - beta / T) with the factorization's lambda_l (the union bound needs no
independence across steps; factorization.py, "Thresholds"). `plan(mechanism="auto")` picks,
per window length T, the one with the smaller worst-step variance at equal zCDP
(`worst_step_errors`: the thresholds and the release's largest error are set by it); the choice
is public (a function of T alone) and stated in every release (`statement`).

Deviations from the paper, on purpose: it uses a per-time Gaussian tail for tau (no union over
the T triggers), which does not bound the probability over the whole window that Thm 3.1 needs;
it counts lg(n) nodes per leaf where a leaf is in ceil(log2(n + 1)); its restart after each
selection leaves keys without new data untested, which the coupling cannot cover beyond round 1,
so every live round here is followed by prediction (Algorithm 4).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.rdp import RdpAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy.stats import norm

from sage_tfx.dp_statistics.continual import factorization
from sage_tfx.dp_statistics.continual.factorization import (BufferedToeplitz, FactorizationIndex,
                                                            WindowFactor)
from sage_tfx.dp_statistics.continual.spec import StreamMechanism
from sage_tfx.mechanisms.portable import floor_log2
from sage_tfx.dp_statistics.continual.tree import TreeIndex, levels, prefix_std, value_grid

CONVERSION_DELTA_SHARE = 2.0 / 3.0  # of delta for the zCDP -> (eps, delta) conversion


def _accountant() -> RdpAccountant:
    """dp-accounting accounts tree aggregation only under REPLACE_SPECIAL (one record replaced
    by a record that contributes zero). Removing a unit from the stream is exactly that here:
    its leaf contributions become zero while the trees' shape and the trigger times are public,
    so add-or-remove-one-unit (the ledger's relation) gets the same bound."""
    return RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)


@dataclass(frozen=True)
class StreamBudget:
    """Everything the operator needs to spend one window's (epsilon, delta)."""
    epsilon: float
    delta: float
    micro_batches: int
    contribution_limit: int
    value_bound: float
    selection_share: float
    selection_sigma: float
    value_sigma: float
    beta: float
    mechanism: StreamMechanism = StreamMechanism.TREE  # TREE or FACTORIZATION (never AUTO)
    decays: tuple[float, ...] = ()  # the BLT decoder (FACTORIZATION): pinned with the budget,
    weights: tuple[float, ...] = ()  # so every engine and restart draws the very same noise

    def __post_init__(self):
        # Stored as JSON (state.py): lists come back, and must compare equal to the plan.
        object.__setattr__(self, "mechanism", StreamMechanism.parse(self.mechanism, "mechanism"))
        object.__setattr__(self, "decays", tuple(self.decays))
        object.__setattr__(self, "weights", tuple(self.weights))
        if self.mechanism is StreamMechanism.AUTO:
            raise ValueError("a budget states the mechanism that runs: tree or factorization")

    @functools.cached_property
    def factor(self) -> WindowFactor:
        return WindowFactor(BufferedToeplitz(self.decays, self.weights), self.micro_batches)

    @property
    def statement(self) -> str:
        """Which mechanism runs, for the release's Guarantee."""
        if self.mechanism is StreamMechanism.TREE:
            return (f"DP-SQLP on {self.micro_batches} micro-batches: binary trees with "
                    f"Honaker's estimator")
        return (f"DP-SQLP on {self.micro_batches} micro-batches: column-normalised BLT "
                f"square-root factorization with {len(self.decays)} buffers")

    def index(self, selection: bool, arrays: Optional[dict] = None) -> TreeIndex:
        """An empty index of the selection or value streams (or the one `arrays` stored)."""
        sigma = self.selection_sigma if selection else self.value_sigma
        thresholds = self.thresholds if selection else None
        if self.mechanism is StreamMechanism.TREE:
            if arrays is None:
                return TreeIndex.empty(sigma, self.micro_batches, thresholds)
            return TreeIndex.from_arrays(sigma, self.micro_batches, thresholds, arrays)
        if arrays is None:
            return FactorizationIndex.empty(sigma, self.micro_batches, thresholds, self.factor)
        return FactorizationIndex.from_arrays(sigma, self.micro_batches, thresholds, arrays,
                                              self.factor)

    @property
    def conversion_delta(self) -> float:
        return self.delta * CONVERSION_DELTA_SHARE

    @property
    def additional_delta(self) -> float:
        """The delta thresholding spends outside the DpEvent: (e^eps + 1) C beta."""
        return (math.exp(self.epsilon) + 1.0) * self.contribution_limit * self.beta

    @property
    def event(self) -> dp_event.DpEvent:
        return _events(self.mechanism, self.micro_batches, self.contribution_limit,
                       self.value_bound, self.selection_sigma, self.value_sigma,
                       (self.decays, self.weights))

    @property
    def record_grid(self) -> tuple[float, float]:
        """(grid, bound): kept values are multiples of `grid` in [-bound, bound]. The grid is
        the release lattice (tree.value_grid), made no coarser than L so a record is not
        rounded away (a count of 1 on a grid of 4 would be 0); bound is the largest grid
        multiple <= L, so rounding a clamped value never exceeds the sensitivity's L."""
        grid = min(value_grid(self.value_sigma),
                   2.0 ** floor_log2(self.value_bound))
        return grid, math.floor(self.value_bound / grid) * grid

    @functools.cached_property
    def thresholds(self) -> np.ndarray:
        """tau_l for l = 1..T (index l - 1): P(Z(l) > tau_l) = beta / T (computed once; read
        only)."""
        if self.mechanism is StreamMechanism.TREE:
            stds = prefix_std(self.micro_batches, self.selection_sigma)
        else:
            stds = factorization.prefix_std(self.factor, self.micro_batches, self.selection_sigma)
        taus = (stds * norm.isf(self.beta / self.micro_batches))
        taus.flags.writeable = False
        return taus

    def achieved_epsilon(self) -> float:
        """Epsilon of the event at the conversion delta, from dp-accounting."""
        return _accountant().compose(self.event).get_epsilon(self.conversion_delta)


@functools.lru_cache(maxsize=64)
def factorization_sensitivities(decays: tuple, weights: tuple, micro_batches: int,
                                contribution_limit: int) -> tuple[float, float]:
    """(one selection stream's sensitivity: one step, weight 1, the largest column norm s of
    the encoder C' that runs; the value streams' for a unit of C records of bound 1, which may
    share steps: the l1 ball of radius C, whose worst point is a vertex, C s)
    (factorization.py, "Sensitivity")."""
    one = WindowFactor(BufferedToeplitz(decays, weights), micro_batches).sensitivity
    return one, contribution_limit * one


def _events(budget_mechanism: StreamMechanism, micro_batches: int, contribution_limit: int,
            value_bound: float, selection_sigma: float, value_sigma: float,
            factor: tuple = ((), ())) -> dp_event.DpEvent:
    if budget_mechanism is StreamMechanism.FACTORIZATION:
        selection_sensitivity, value_sensitivity = factorization_sensitivities(
            *factor, micro_batches, contribution_limit)
        selection = dp_event.SelfComposedDpEvent(
            dp_event.GaussianDpEvent(selection_sigma / selection_sensitivity),
            contribution_limit)
        values = dp_event.GaussianDpEvent(value_sigma / (value_sensitivity * value_bound))
        return dp_event.ComposedDpEvent([selection, values])
    selection = dp_event.SelfComposedDpEvent(
        dp_event.SingleEpochTreeAggregationDpEvent(selection_sigma, micro_batches),
        contribution_limit)
    values = dp_event.SingleEpochTreeAggregationDpEvent(
        value_sigma / (contribution_limit * value_bound), micro_batches)
    return dp_event.ComposedDpEvent([selection, values])


def _check(epsilon, delta, micro_batches, contribution_limit, value_bound,
           selection_share) -> None:
    problems = []
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        problems.append(f"epsilon must be a positive number, got {epsilon!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        problems.append(f"delta must be in (0, 1), got {delta!r}")
    if not (isinstance(micro_batches, int) and micro_batches >= 1):
        problems.append(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if not (isinstance(contribution_limit, int) and contribution_limit >= 1):
        problems.append(f"contribution_limit must be a positive integer, got "
                        f"{contribution_limit!r}")
    if not (isinstance(value_bound, (int, float)) and math.isfinite(value_bound)
            and value_bound > 0):
        problems.append(f"value_bound must be a positive number, got {value_bound!r}")
    if not (isinstance(selection_share, float) and 0 < selection_share < 1):
        problems.append(f"selection_share must be a float in (0, 1), got {selection_share!r}")
    if problems:
        raise ValueError("; ".join(problems))


def worst_step_errors(micro_batches: int) -> dict[StreamMechanism, float]:
    """Per mechanism, the largest over steps t = 1..T of the variance of the prefix noise at t
    at zCDP rho = 1/2 per unit of sensitivity (sigma = the sensitivity): sensitivity^2 x
    max_t Var Z(t) / sigma^2. The worst step is what the release pays: the selection
    threshold is tau_l = lambda_l Phi^{-1}(1 - beta / T) at every step (a key crosses late,
    when its count is largest), and a continual release's error is its largest over the
    window. Both sums of the operator scale alike (a factor C, or C L, on both mechanisms'
    sensitivities), so one number decides for both."""
    tree = levels(micro_batches) * float(np.max(prefix_std(micro_batches, 1.0) ** 2))
    factor = WindowFactor(factorization.fit_square_root(micro_batches), micro_batches)
    return {StreamMechanism.TREE: tree,
            StreamMechanism.FACTORIZATION: factor.sensitivity ** 2 * float(
                np.max(factor.prefix_variances(micro_batches)))}


def choose(mechanism: StreamMechanism, micro_batches: int) -> StreamMechanism:
    """AUTO: the mechanism of the smaller worst-step error for T (the tree on a tie, T = 1)."""
    if mechanism is not StreamMechanism.AUTO:
        return mechanism
    errors = worst_step_errors(micro_batches)
    return (StreamMechanism.FACTORIZATION
            if errors[StreamMechanism.FACTORIZATION] < errors[StreamMechanism.TREE]
            else StreamMechanism.TREE)


def plan(epsilon: float, delta: float, micro_batches: int, contribution_limit: int,
         value_bound: float = 1.0, selection_share: float = 0.5,
         mechanism: str = StreamMechanism.TREE) -> StreamBudget:
    """Calibrate the selection and value noise to (epsilon, delta) for a window of
    `micro_batches` triggers, on trees, the BLT factorization, or (AUTO) the better of the
    two for T."""
    _check(epsilon, delta, micro_batches, contribution_limit, value_bound, selection_share)
    mechanism = choose(StreamMechanism.parse(mechanism, "mechanism"), micro_batches)
    # With scale k: rho_s = share / k^2 and rho_v = (1 - share) / k^2, so rho = 1 / k^2.
    if mechanism is StreamMechanism.TREE:
        factor = ((), ())
        depth = levels(micro_batches)
        selection_unit = math.sqrt(contribution_limit * depth / (2.0 * selection_share))
        value_unit = contribution_limit * value_bound * math.sqrt(
            depth / (2.0 * (1.0 - selection_share)))
    else:
        fitted = factorization.fit_square_root(micro_batches)
        factor = (fitted.decays, fitted.weights)
        selection_sensitivity, value_sensitivity = factorization_sensitivities(
            *factor, micro_batches, contribution_limit)
        selection_unit = selection_sensitivity * math.sqrt(contribution_limit
                                                           / (2.0 * selection_share))
        value_unit = value_sensitivity * value_bound / math.sqrt(2.0 * (1.0 - selection_share))

    def event(scale: float) -> dp_event.DpEvent:
        return _events(mechanism, micro_batches, contribution_limit, value_bound,
                       scale * selection_unit, scale * value_unit, factor)

    conversion_delta = delta * CONVERSION_DELTA_SHARE
    scale = mechanism_calibration.calibrate_dp_mechanism(
        _accountant, event, epsilon, conversion_delta,
        mechanism_calibration.LowerEndpointAndGuess(1e-6, 1.0), tol=1e-9)
    # brentq returns a root within tol; step up until the event provably meets epsilon.
    while _accountant().compose(event(scale)).get_epsilon(conversion_delta) > epsilon:
        scale *= 1.0 + 1e-9
    beta = delta * (1.0 - CONVERSION_DELTA_SHARE) / (
        (math.exp(epsilon) + 1.0) * contribution_limit)
    return StreamBudget(float(epsilon), float(delta), micro_batches, contribution_limit,
                        float(value_bound), selection_share, scale * selection_unit,
                        scale * value_unit, beta, mechanism, *factor)
