"""How a block's budget is accounted: basic composition or a Rényi-DP filter.

A block's state is a budget *vector*: `[epsilon, delta]` under basic composition, or one RDP value
per order under the Rényi filter, of exact fractions (exact.exact_vector). Each mode is one object (`accounting_for`, chosen once when a
ledger opens) answering the same questions, so the ledger, the allocation policy and the CLI's
tables never branch on the mode (the tables ask the object how to present its units):

* `capacity(epsilon_g, delta_g)`: the vector a fresh block may spend;
* `demand(request)`: the vector a request charges; `grant_demand(request, split, events,
  additional_delta)`: what a grant charges given what its steps run (an rdp ledger refuses delta
  spent outside the events), and `granted_epsilon` what it records as granted;
* `fits(used, demand, limit)`: may `used + demand` be spent against `limit`?
* `requires_step_events`: must a grant give the DP event of every step of its split?
* `guarantee(spent, ...)`, `budget_view(block, pipeline)` and `remaining(block, pipeline)`: what a
  block has given up and has left, in the unit the ledger grants;
* for tables: `show_note`, `show_columns` and `show_scale` (how `sage-tfx ledger show` lays
  out a block in the mode's unit), `summary_unit` (budget_view's unit across blocks),
  `guarantee_is_spent` (guarantee is the sums spent) and `guarantee_note` (what guarantee
  means, where it is not the sums spent).

Neighbouring relation: add-or-remove-one record (Sage Appendix A.1). A request states its
(epsilon, delta) or RDP curve already in that relation; mechanisms analysed under replace-one must
convert before asking (see docs/architecture.md).

Exact arithmetic
----------------
Budget vectors hold fractions, and every sum, difference and comparison of them is exact
(sage_access/exact.py). Under basic composition each epsilon and delta is the decimal it is
written as, so the ledger charges, compares and reports exactly what was requested: 20 grants of
0.05 spend a ceiling of 1 exactly, and what a denial calls available can be granted. Under the
Rényi filter the curves (dp-accounting's) and the capacity (closed form below) are computed in
doubles, a few ulps from the real values; the ledger takes each double as written and adds no
rounding of its own when it sums and compares them.

Basic composition (Sage Theorem 4.3, proof in Appendix A.2)
-----------------------------------------------------------
AdaptiveStreamBlockCompose is (epsilon_g, delta_g)-DP if, for every block, the epsilons and the
deltas of all queries that used the block each sum to at most the ceiling, even when blocks and
parameters are chosen adaptively (the proof conditions on the history and applies a union bound
over the queries). So `fits` is component-wise: `used + demand <= limit` for both entries.

Rényi-DP filter
---------------
Each block keeps `spent[a] = sum_i rho_i(a)` over a fixed set of orders A. A grant is admitted on
the block only if, with the new curve included, some order a in A still satisfies
`spent[a] <= capacity[a]`, where `capacity[a]` is the largest RDP value at order a that converts
to (epsilon_g, delta_g / |A|)-DP.

Why this is valid although every rho_i is chosen adaptively (after seeing earlier outputs):
Feldman & Zrnic, "Individual Privacy Accounting via a Rényi Filter" (NeurIPS 2021, Thm 3.1/4.5)
show that for a fixed order a, with L_t the privacy loss of the first t outputs,
M_t = exp((a - 1) * (L_t - sum_{i<=t} rho_i(a))) is a non-negative supermartingale (each rho_i is
fixed before step i runs, and the step's Rényi divergence at a is at most rho_i(a)); hence
E[M_T] <= 1 at any stopping time T. Our filter keeps running while *some* order is within
capacity, so a single order's sum may exceed its capacity. We therefore split the outcomes:
every transcript the ledger allows has, at the end, at least one order a* whose final sum is within
capacity (the order that admitted the last grant; sums only grow). Assign each transcript to one
such order; on the part A_a assigned to a, E[exp((a-1) L) 1{A_a}] <= exp((a-1) capacity[a]) by the
supermartingale bound. The hockey-stick divergence splits over the partition, and on each part the
argument of Canonne, Kamath & Steinke ("The Discrete Gaussian for DP", Prop. 12), which uses only
that exponential moment, bounds it by delta_g / |A|. Summing over |A| orders gives delta_g.
(Lécuyer, "Practical Privacy Filters and Odometers with Rényi DP", 2021, applies RDP filters to
Sage's block composition; we take the union bound over orders explicitly rather than rely on a
tighter multi-order argument. It costs log(|A|) / (a - 1) of epsilon at order a.)

The per-order conversion is dp-accounting's (`rdp_privacy_accountant.compute_epsilon`, the
Canonne-Kamath-Steinke bound); `capacity` inverts it in closed form and a test checks the round
trip against dp-accounting. dp-accounting's extra KL shortcut (epsilon 0 for curves below delta^2)
is not a tail bound, so the filter never relies on it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, Optional, Sequence

import attr
import numpy as np

from sage_tfx.choices import Choice
from sage_tfx.sage_access import allocation
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.sage_access.exact import (exact_decimal, exact_fraction, exact_text, exact_vector,
                                        float_at_most)

# A fixed grid: every block's curve and every request's curve live on these orders.
# Few orders keep the union bound's cost small (log 16 / (a - 1)); the range covers the
# DP-SGD regime (large orders for small epsilons) and Laplace-style requests (small orders).
DEFAULT_RDP_ORDERS: tuple[float, ...] = (
    1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 32.0, 48.0, 64.0, 128.0)


def _check_epsilon(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise BadRequest(f"{what} must be a positive finite number, got {value!r}")
    return value


def _check_delta(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or value >= 1:
        raise BadRequest(f"{what} must be in [0, 1), got {value!r}")
    return value


@dataclass(frozen=True)
class BudgetRequest:
    """What a pipeline asks to spend: (epsilon, delta), or an RDP curve on the ledger's orders.

    With an RDP curve under basic composition, `delta` is required: the curve is converted to
    (epsilon, delta) for that delta.
    """

    epsilon: Optional[float] = None
    delta: Optional[float] = None
    rdp_curve: Optional[tuple[float, ...]] = None

    def __post_init__(self):
        if self.rdp_curve is None:
            if self.epsilon is None or self.delta is None:
                raise BadRequest("a request needs epsilon and delta, or an rdp_curve")
            object.__setattr__(self, "epsilon", _check_epsilon(self.epsilon, "epsilon"))
            object.__setattr__(self, "delta", _check_delta(self.delta, "delta"))
            return
        if self.epsilon is not None:
            raise BadRequest("give either epsilon or an rdp_curve, not both")
        curve = tuple(float(v) for v in self.rdp_curve)
        if not curve or any(not math.isfinite(v) or v < 0 for v in curve):
            raise BadRequest(f"rdp_curve must be non-empty, finite and non-negative, got {curve!r}")
        object.__setattr__(self, "rdp_curve", curve)
        if self.delta is not None:
            object.__setattr__(self, "delta", _check_delta(self.delta, "delta"))


@dataclass(frozen=True)
class ShowColumn:
    """A column of `sage-tfx ledger show`: its title, width and the cell of one block's row
    (sage_access.views.block_row: the ceilings, the guarantee and budget_view under "budget")."""
    title: str
    width: int
    cell: Callable[[dict], str]


def _reserved(row: dict) -> float:
    return sum(row["budget"]["reserved"].values())


class AccountingMode(Choice):
    """How a ledger composes the grants on a block: BasicComposition or RenyiFilter."""
    BASIC = "basic"
    RDP = "rdp"


class BasicComposition:
    """Sage Theorem 4.3: per block, epsilons and deltas each sum to at most the ceiling."""

    name = AccountingMode.BASIC
    # RDP curves of requests are given on these orders and converted on arrival.
    orders: tuple[float, ...] = DEFAULT_RDP_ORDERS
    summary_unit = "epsilon"
    show_note: Optional[str] = None
    show_scale = 1  # budget_view's values as `show` prints them (reservations included)
    show_columns = (
        ShowColumn("eps spent", 9, lambda row: f"{row['budget']['spent']:.4f}"),
        ShowColumn("reserved", 9, lambda row: f"{_reserved(row):.4f}"),
        ShowColumn("free", 9, lambda row: f"{row['budget']['free']:.4f}"),
        ShowColumn("eps ceiling", 11, lambda row: f"{row['epsilon_ceiling']:.4f}"),
        ShowColumn("delta spent", 11, lambda row: f"{row['delta_spent']:.3g}"),
        ShowColumn("delta ceil", 10, lambda row: f"{row['delta_ceiling']:.3g}"))
    guarantee_is_spent = True
    guarantee_note: Optional[str] = None

    def capacity(self, epsilon_g: float, delta_g: float) -> np.ndarray:
        return exact_vector([_check_epsilon(epsilon_g, "epsilon ceiling"),
                             _check_delta(delta_g, "delta ceiling")])

    def demand(self, request: BudgetRequest) -> np.ndarray:
        if request.rdp_curve is None:
            return exact_vector([request.epsilon, request.delta])
        if request.delta is None or request.delta == 0:
            raise BadRequest("under basic composition an rdp_curve request needs a delta > 0 "
                             "to convert the curve to (epsilon, delta)")
        orders = self.orders
        if len(request.rdp_curve) != len(orders):
            raise BadRequest(f"rdp_curve has {len(request.rdp_curve)} values; the ledger's "
                             f"orders are {list(orders)}")
        from dp_accounting.rdp import rdp_privacy_accountant

        # One mechanism, parameters fixed before it runs: the standard conversion applies.
        epsilon, _ = rdp_privacy_accountant.compute_epsilon(orders, request.rdp_curve, request.delta)
        if not math.isfinite(epsilon):
            raise BadRequest("the rdp_curve does not convert to a finite epsilon")
        return exact_vector([float(epsilon), request.delta])

    def zero(self) -> np.ndarray:
        return exact_vector([0, 0])

    def fits(self, used: np.ndarray, demand: np.ndarray, limit: np.ndarray) -> bool:
        # Exact: the ledger stores exactly `used + demand`, so this comparison is what bounds
        # the ceiling, with no rounding either way. Element by element in Python: numpy's
        # ufuncs on two-element arrays of fractions cost more than the fractions' own
        # arithmetic (a grant of 30 blocks asks 90 times).
        return all(u + d <= l for u, d, l in zip(used, demand, limit))

    def guarantee(self, spent: np.ndarray, epsilon_g: float, delta_g: float) -> tuple[float, float]:
        """The (epsilon, delta) the block has given up so far."""
        return float(spent[0]), float(spent[1])

    # A step without a DP event known before it runs is charged its (epsilon, delta) share.
    requires_step_events = False

    def grant_demand(self, request: BudgetRequest, split: Mapping[str, str],
                     events: Mapping[str, object], additional_delta: float = 0.0) -> np.ndarray:
        """What a grant charges: the (epsilon, delta) of the request, whatever its steps run.
        `additional_delta` (delta its steps spend outside their events, e.g. partition
        selection's) is part of that delta, so it may not exceed it."""
        additional_delta = _check_delta(additional_delta, "additional_delta")
        if exact_fraction(additional_delta) > exact_fraction(request.delta or 0.0):
            raise BadRequest(f"the steps spend additional delta {additional_delta:g} outside "
                             f"their events, more than the grant's delta {request.delta}")
        return self.demand(request)

    def granted_epsilon(self, request: BudgetRequest, demand: np.ndarray) -> float:
        """The epsilon a grant records: the request's, or what its RDP curve converted to."""
        return request.epsilon if request.epsilon is not None else float(demand[0])

    def budget_view(self, block: allocation.BlockState, pipeline: Optional[str] = None) -> dict:
        """What the block has spent, reserved, free and available to `pipeline` (module
        docstring), in epsilon: a request fits when its epsilon is within its
        pipeline's reservation plus the free budget, and likewise for delta."""
        reservations, free, available = _budget_parts(block, pipeline)
        return {"unit": self.summary_unit, "total": block.epsilon_ceiling,
                "spent": float(block.spent[0]),
                "reserved": {k: float(v[0]) for k, v in reservations.items()},
                "delta_reserved": {k: float(v[1]) for k, v in reservations.items()},
                "free": float(free[0]), "delta_free": float(free[1]),
                "available": float(max(available[0], 0.0))}

    def remaining(self, block: allocation.BlockState, pipeline: Optional[str] = None) -> str:
        """A readable account of what the block has left: the sums spent, the (epsilon, delta)
        `pipeline` may still draw and what is reserved for the other waiting pipelines. Exact:
        the sums and ceilings as the decimals they are, and what is available rounded down to
        the nearest decimal that can be requested (a request of exactly that fits)."""
        who = pipeline or "unallocated grants"
        free = np.maximum(allocation.available_to(block, pipeline), 0) * (not block.retired)
        spent, ceiling = (", ".join(_number(exact_text(v)) for v in pair) for pair in
                          (block.spent, block.capacity))
        available = ", ".join(_number(exact_decimal(float_at_most(v))) for v in free)
        text = (f"spent ({spent}) of ceiling ({ceiling}), available to {who}: ({available})")
        return _with_reservations(text, self.budget_view(block, pipeline), block, pipeline,
                                  lambda value: f"{value:.6g}")


class RenyiFilter:
    """A Rényi-DP filter per block; see the module docstring for why it is valid."""

    name = AccountingMode.RDP
    summary_unit = "share of capacity"  # budget_view's order differs between blocks
    show_note = ("guarantee: each charged block's ceiling, enforced by its Renyi filter. "
                 "spent/reserved/free: % of the filter's capacity at the order with most room")
    show_scale = 100  # budget_view's shares, in %
    show_columns = (
        ShowColumn("spent %", 8, lambda row: f"{100 * row['budget']['spent']:.1f}"),
        ShowColumn("reserved %", 10, lambda row: f"{100 * _reserved(row):.1f}"),
        ShowColumn("free %", 7, lambda row: f"{100 * row['budget']['free']:.1f}"),
        ShowColumn("order", 5, lambda row: f"{row['budget']['order']:g}"),
        ShowColumn("guarantee eps", 13, lambda row: f"{row['guarantee_epsilon']:.4g}"),
        ShowColumn("delta", 8, lambda row: f"{row['guarantee_delta']:.3g}"))
    guarantee_is_spent = False
    guarantee_note = (
        "each block's Renyi filter enforces its (epsilon, delta) ceiling: guarantee_epsilon "
        "and guarantee_delta are the ceiling once the block was charged, (0, 0) before; "
        "budget gives spent, reserved and free as shares of the filter's capacity at the "
        "order with the most free room")

    def __init__(self, orders: Sequence[float] = DEFAULT_RDP_ORDERS):
        self.orders = tuple(float(a) for a in orders)
        if any(a <= 1.01 for a in self.orders):
            raise BadRequest("RDP orders must be > 1.01 (the conversion is unstable near 1)")

    def _conversion_offset(self, delta_g: float) -> np.ndarray:
        """Per order a, dp-accounting's conversion is epsilon = rho + offset[a] at delta_g / |A|:
        offset[a] = log1p(-1/a) - log(delta * a) / (a - 1)  (Canonne-Kamath-Steinke, Prop. 12)."""
        a = np.array(self.orders)
        per_order_delta = delta_g / len(self.orders)
        return np.log1p(-1.0 / a) - np.log(per_order_delta * a) / (a - 1.0)

    def capacity(self, epsilon_g: float, delta_g: float) -> np.ndarray:
        epsilon_g = _check_epsilon(epsilon_g, "epsilon ceiling")
        delta_g = _check_delta(delta_g, "delta ceiling")
        if delta_g == 0:
            raise BadRequest("an RDP ledger needs a delta ceiling > 0")
        return np.array(self._exact_capacity(epsilon_g, delta_g), dtype=object)

    @functools.lru_cache(maxsize=1024)
    def _exact_capacity(self, epsilon_g: float, delta_g: float) -> tuple:
        """The capacity's exact values, computed once per ceiling (every block read asks)."""
        return tuple(exact_vector(np.maximum(0.0, epsilon_g - self._conversion_offset(delta_g))))

    def demand(self, request: BudgetRequest) -> np.ndarray:
        if request.rdp_curve is not None:
            if len(request.rdp_curve) != len(self.orders):
                raise BadRequest(f"rdp_curve has {len(request.rdp_curve)} values; the ledger's "
                                 f"orders are {list(self.orders)}")
            return exact_vector(request.rdp_curve)
        if request.delta > 0:
            raise BadRequest("an RDP ledger cannot charge an (epsilon, delta>0) request: such a "
                             "guarantee has no finite RDP curve; pass the mechanism's rdp_curve")
        return exact_vector(pure_dp_rdp_curve(request.epsilon, self.orders))

    def zero(self) -> np.ndarray:
        return exact_vector([0] * len(self.orders))

    def fits(self, used: np.ndarray, demand: np.ndarray, limit: np.ndarray) -> bool:
        return any(u + d <= l for u, d, l in zip(used, demand, limit))  # as BasicComposition

    def guarantee(self, spent: np.ndarray, epsilon_g: float, delta_g: float) -> tuple[float, float]:
        """What the block's filter certifies: (epsilon_g, delta_g) once anything was charged,
        (0, 0) before. Converting today's sums (min over orders of spent + offset) would be an
        odometer reading, which is not a valid bound when the grants were chosen adaptively: the
        filter's theorem (module docstring) holds for the ceiling only."""
        if not np.any(spent > 0):
            return 0.0, 0.0
        return float(epsilon_g), float(delta_g)

    # The filter charges RDP curves: every step of an (epsilon, delta > 0) grant needs its event.
    requires_step_events = True

    def grant_demand(self, request: BudgetRequest, split: Mapping[str, str],
                     events: Mapping[str, object], additional_delta: float = 0.0) -> np.ndarray:
        """What a grant charges: an (epsilon, delta > 0) grant charges the RDP curve of its
        steps' events ((epsilon, delta) is the target they were calibrated to); otherwise the
        request's own curve (`demand`).

        A grant whose steps spend delta outside their events (`additional_delta` > 0, e.g.
        partition selection's, mechanisms.Release) is refused: a (0, delta) part has no finite
        RDP curve, and the filter's conversion already gives each block's whole delta ceiling
        to the RDP curve (delta_g / |A| per order), so no delta is left to charge it on.
        Charging it soundly needs a share of delta_g set aside for such deltas when the block
        is created (a second budget entry), which this filter does not keep."""
        if _check_delta(additional_delta, "additional_delta") > 0:
            raise BadRequest(
                f"an rdp ledger cannot charge delta spent outside the steps' DP events "
                f"(additional delta {additional_delta:g}, e.g. partition selection's): an RDP "
                "curve cannot carry it; use a basic ledger (or, for DP SQL, public_groups)")
        if request.rdp_curve is None and request.delta > 0:
            missing = sorted(set(split) - set(events))
            if not split or missing:
                raise BadRequest(
                    "an rdp ledger charges the RDP curve of what the steps run: give the DP "
                    f"event of every step of the split (missing: {missing or 'a split'})")
            return self.demand(BudgetRequest(
                rdp_curve=tuple(rdp_curve_of(list(events.values()), self.orders)),
                delta=request.delta))
        return self.demand(request)

    def granted_epsilon(self, request: BudgetRequest, demand: np.ndarray) -> Optional[float]:
        """The epsilon a grant records: the request's; an RDP curve grants no epsilon."""
        return request.epsilon

    def budget_view(self, block: allocation.BlockState, pipeline: Optional[str] = None) -> dict:
        """What the block has spent, reserved, free and available to `pipeline` (module
        docstring), as shares of the filter's capacity at one order, the order with the
        most room for `pipeline` (the filter admits a curve while some order still fits, so no
        single epsilon describes a spent curve; ties go to the least spent order). A view, in
        doubles."""
        reservations, free, available = _budget_parts(block, pipeline)
        reservations = {name: value.astype(float) for name, value in reservations.items()}
        free, available = free.astype(float), available.astype(float)
        capacity, spent = block.capacity.astype(float), block.spent.astype(float)
        usable = capacity > 0
        safe_capacity = np.where(usable, capacity, 1.0)
        fraction = lambda v: np.where(usable, v / safe_capacity, 0.0)  # noqa: E731
        room = np.where(usable, fraction(available), -np.inf)
        best = int(np.lexsort((fraction(spent), -room))[0])
        share = lambda v: float(min(1.0, max(0.0, fraction(v)[best])))  # noqa: E731
        return {"unit": f"share of RDP capacity at order {self.orders[best]:g}", "total": 1.0,
                "order": self.orders[best],
                "spent": share(spent) if usable[best] else 1.0,
                "reserved": {k: share(v) for k, v in reservations.items()},
                "free": share(free), "available": share(available)}

    def remaining(self, block: allocation.BlockState, pipeline: Optional[str] = None) -> str:
        """A readable account of what the block has left: the filter certifies its ceiling; its
        capacity at one order (budget_view) tells what is left, and what is reserved for the
        other waiting pipelines."""
        epsilon_g, delta_g = self.guarantee(block.spent, block.epsilon_ceiling,
                                            block.delta_ceiling)
        view = self.budget_view(block, pipeline)
        who = pipeline or "unallocated grants"
        text = (f"filter guarantee ({epsilon_g:.6g}, {delta_g:.3g}) of ceiling "
                f"({block.epsilon_ceiling:.6g}, {block.delta_ceiling:.3g}); at RDP order "
                f"{view['order']:g} (most room for {who}): spent {view['spent']:.1%}, "
                f"available to {who} {view['available']:.1%}")
        return _with_reservations(text, view, block, pipeline, lambda value: f"{value:.1%}")


# Both modes' `budget_view` is in the unit the ledger grants (what `show`, `plot` and denial
# messages say); a retired block has nothing free.
def _budget_parts(block: allocation.BlockState, pipeline: Optional[str]):
    """(reservations, free, available to `pipeline`) of a block, as budget vectors."""
    reservations = {name: np.maximum(v, 0) for name, v in sorted(block.reservations.items())}
    # A retired block grants nothing again: its leftover (below the minimum request) is not free.
    live = not block.retired
    free = np.maximum(allocation.free_budget(block), 0) * live
    return reservations, free, allocation.available_to(block, pipeline) * live


def _with_reservations(text: str, view: dict, block: allocation.BlockState,
                       pipeline: Optional[str], unit) -> str:
    """`text`, then what `view` reserves for the other waiting pipelines (in `unit`)."""
    others = {name: value for name, value in view["reserved"].items()
              if name != pipeline and value > 0}
    text += ", reserved for other pipelines: " + (", ".join(
        f"{name} {unit(value)}" for name, value in others.items()) or "none")
    return text + (", retired" if block.retired else "")


def _number(text: str) -> str:
    """A budget's decimal text for a message, without a trailing ".0" ("1", "0.95", "1e-06")."""
    return text.removesuffix(".0")


def pure_dp_rdp_curve(epsilon: float, orders: Sequence[float]) -> np.ndarray:
    """RDP curve of any pure epsilon-DP mechanism: (epsilon^2 / 2)-zCDP (Bun & Steinke 2016,
    Prop. 3.3) gives a * epsilon^2 / 2 at order a, and a Rényi divergence never exceeds epsilon."""
    a = np.asarray(orders, dtype=float)
    return np.minimum(epsilon, a * epsilon ** 2 / 2.0)


def accounting_for(name: str) -> BasicComposition | RenyiFilter:
    try:
        mode = AccountingMode.parse(name, "accounting mode")
    except ValueError as error:
        raise BadRequest(str(error)) from None
    return BasicComposition() if mode == AccountingMode.BASIC else RenyiFilter()


# --------------------------------------------------------------------- DP events of a grant
# A grant records the dp-accounting event each of its steps will run, so the ledger can charge
# it in either mode and each step can check that what it runs is what was recorded.

# dp_accounting is imported where it is used: importing it takes most of a second, and the
# ledger's CLI and its concurrent writers need none of it for basic accounting.
@functools.cache
def _event_types() -> dict:
    from dp_accounting import dp_event

    return {cls.__name__: cls for cls in (
        dp_event.GaussianDpEvent, dp_event.LaplaceDpEvent, dp_event.ZCDpEvent,
        # Truncated-geometric partition selection (DP statistics) runs discrete Laplace noise.
        dp_event.DiscreteLaplaceDpEvent,
        # The DP-SQLP streaming operator's selection and value trees (dp_statistics/continual).
        dp_event.SingleEpochTreeAggregationDpEvent,
        dp_event.PoissonSampledDpEvent, dp_event.SelfComposedDpEvent, dp_event.ComposedDpEvent,
        # Private selection for tuning (mechanisms/private_selection.py).
        dp_event.RepeatAndSelectDpEvent,
        dp_event.NoOpDpEvent)}


def event_to_json(event: dp_event.DpEvent):
    """A JSON-able form of a dp-accounting event (nested events included)."""
    from dp_accounting import dp_event

    name = type(event).__name__
    if name not in _event_types():
        raise BadRequest(f"a grant cannot record a {name}; supported: {sorted(_event_types())}")

    def encode(value):
        if isinstance(value, dp_event.DpEvent):
            return event_to_json(value)
        if isinstance(value, (list, tuple)):
            return [encode(item) for item in value]
        return value

    return {"type": name, **{field.name: encode(getattr(event, field.name))
                             for field in attr.fields(type(event))}}


def event_from_json(data) -> dp_event.DpEvent:
    if not isinstance(data, dict) or data.get("type") not in _event_types():
        raise BadRequest(f"not a recorded DP event: {data!r}")

    def decode(value):
        if isinstance(value, dict):
            return event_from_json(value)
        if isinstance(value, list):
            return [decode(item) for item in value]
        return value

    fields = {key: decode(value) for key, value in data.items() if key != "type"}
    return _event_types()[data["type"]](**fields)


def pure_dp_event(epsilon: float) -> dp_event.DpEvent:
    """The event of a step that is epsilon-DP whatever it composes inside (e.g. several Laplace
    releases whose epsilons sum to `epsilon`): an epsilon-DP mechanism is (epsilon^2 / 2)-zCDP
    (Bun & Steinke 2016, Prop. 3.3), i.e. RDP a * epsilon^2 / 2 at every order a."""
    from dp_accounting import dp_event

    return dp_event.ZCDpEvent(_check_epsilon(epsilon, "epsilon") ** 2 / 2.0)


def rdp_curve_of(events: Sequence[dp_event.DpEvent], orders: Sequence[float]) -> np.ndarray:
    """RDP curve, on `orders`, of the composition of `events` under add-or-remove-one
    (dp-accounting's RdpAccountant; it refuses events it cannot account, e.g. sampling without
    replacement, whose analysis is replace-one)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(
        list(orders), rdp_privacy_accountant.NeighborRel.ADD_OR_REMOVE_ONE)
    composed = dp_event.ComposedDpEvent(list(events))
    if not accountant.supports(composed):
        raise BadRequest(f"the RDP accountant cannot account {composed} under add-or-remove-one; "
                         "this grant cannot be charged on an rdp ledger")
    accountant.compose(composed)
    return np.array(accountant.rdp, dtype=float)


# --------------------------------------------------------------------- exact budget splits

def check_split(split: Mapping[str, object]) -> dict[str, str]:
    """A split of a grant among named DP steps: positive fractions summing to at most 1 in exact
    arithmetic (decimal fractions as written: 0.1 + 0.5 + 0.4 is exactly 1). Returned as
    {step: exact decimal string}."""
    if not split:
        raise BadRequest("the budget split is empty")
    clean = {}
    for step, fraction in split.items():
        if not isinstance(step, str) or not step:
            raise BadRequest(f"split step {step!r} must be a non-empty name")
        if exact_fraction(fraction) <= 0:
            raise BadRequest(f"split step {step!r} needs a positive fraction, got {fraction!r}")
        clean[step] = str(fraction) if isinstance(fraction, str) else exact_decimal(fraction)
    total = sum(exact_fraction(f) for f in clean.values())
    if total > 1:
        raise BadRequest(f"the split fractions sum to {float(total)!r} > 1 (exactly {total}): "
                         f"{clean}")
    return clean


def split_share(epsilon: float, delta: float, split, step: str) -> tuple[float, float]:
    """The (epsilon, delta) that `step` of a (checked) split gets of a grant of (epsilon,
    delta): each its exact fraction, rounded down (share_of)."""
    fraction = exact_fraction(split[step])
    return share_of(epsilon, fraction), share_of(delta, fraction)


def share_of(total: float, fraction: Fraction) -> float:
    """total * fraction, rounded down to a double: the shares of a split whose fractions sum to
    at most 1 then sum to at most `total` (each is at most its exact value)."""
    exact = exact_fraction(total) * fraction
    share = float(exact)
    return math.nextafter(share, 0.0) if Fraction(share) > exact else share
