"""Multi-pipeline workloads on the real BlockLedger (Sage §3.2, §5.4, Fig. 8): the simulator
behind benchmarks/workload.py (a research tool beside the benchmarks, not part of the package).

A discrete-time simulation, one step per hour:
  1. `samples_per_hour` new samples arrive as one block with budget (block_epsilon, block_delta).
  2. Pipelines arrive with Gamma inter-arrival times (mean 1 / arrival rate). Each one needs a
     number of samples that depends on the epsilon it trains with (`SampleComplexity`): a
     power-law non-private need n0, made a curve n(epsilon) by one of COMPLEXITY_MODELS, the
     synthetic n0 (1 + 0.1 / epsilon) or the shape measured on the taxi AdaSSP pipeline.
  3. Every waiting pipeline makes up to `attempts_per_hour` attempts: the strategy asks the
     ledger for a grant, and the pipeline is released (ACCEPT) if the granted data suffices at the granted
     epsilon. Otherwise the budget stays spent (RETRY) and the pipeline tries again, or waits
     for new blocks when the ledger cannot pay what it asks for.

All budget goes through `sage_tfx.sage_access.BlockLedger` (MLMD's in-memory store). The ledger
enforces the ceilings, splits new blocks among waiting pipelines and returns the reservations of
finished ones; what a pipeline may draw is the ledger's own rule (allocation.available_to), and
the block strategies retry by the driver's rule (pipelines/policy.after_retry). The strategies
only decide what to ask for:

* query: query-level composition. The whole stream is one database with one budget, so every
  grant charges the single `stream` block, whatever data it uses. Pipelines train on all data
  so far and double epsilon on RETRY (doubling data means waiting for it).
* streaming: streaming composition. Each sample is used once, by one pipeline. Unused blocks
  go to the oldest waiting pipeline until it holds enough of them to train at the full block
  budget. That grant spends those blocks entirely.
* block_aggressive: block composition, and a pipeline "uses as much privacy budget as is
  available when it is invoked" (Sage §5.4): of the grants it can draw (w blocks at the w-th
  largest of its allowances), the one that spends the most budget, w x epsilon. On RETRY it
  waits until twice as many blocks can pay.
* block_conserve: block composition with Sage's privacy-adaptive training (§3.3, and §6:
  "we use as much data as is available ... with the lowest privacy budget"). Start at
  `initial_epsilon` on every block that can pay it. On RETRY, double epsilon if as many blocks
  can pay the double, otherwise wait until twice as many blocks can pay.
  Under load a block's share can fall below the planned epsilon, and the plan must then shrink
  to what the blocks offer or wait forever. Sage's bound (failed iterations cost at most the
  accepted one) needs every retry to double its resources, so a retry must have at least twice
  the previous RETRY's epsilon x blocks (the noise of a DP sum over n records at epsilon scales
  like 1 / (n epsilon)): shrinking epsilon without that much more data would spend budget on a
  model no better than the one just rejected.

Release time is the release hour minus the arrival hour. A pipeline not released by the end of
the simulation counts as unreleased, and as released at the last hour (the horizon).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

from sage_tfx.pipelines.policy import PolicyName, after_retry
from sage_tfx.sage_access import BlockIds, BlockLedger, BudgetExhausted, RecentWindow
from sage_tfx.sage_access.allocation import available_to

STRATEGIES = ("query", "streaming", "block_aggressive", "block_conserve")
RELEASED, RETRY, WAIT = "released", "retry", "wait"


class SampleComplexity(Protocol):
    def samples_needed(self, epsilon: float) -> float:
        """Samples with which the pipeline is ACCEPTed when trained at `epsilon`."""


@dataclass(frozen=True)
class InverseEpsilonComplexity:
    """n(eps) = nonprivate_samples * (1 + epsilon_scale / eps), a synthetic curve: the DP error
    term of the Laplace/Gaussian mechanisms and of DP-SGD shrinks like 1 / (eps n), so the
    samples needed grow like 1 / eps at small epsilon and approach the non-private need at large
    epsilon. At epsilon_scale 0.1 a pipeline needs 10% more data at epsilon 1 than without DP."""
    nonprivate_samples: float
    epsilon_scale: float = 0.1

    def samples_needed(self, epsilon: float) -> float:
        return self.nonprivate_samples * (1.0 + self.epsilon_scale / epsilon)


# c2 / c1 of the taxi AdaSSP pipeline's SLAed loss test, in sqrt(samples): the least-squares fit
# of benchmarks/taxi_sample_complexity.py over 24 single iterations (12, 24, 36 months x epsilon
# 0.25-2 x 2 seeds; 4,388-14,163 records), within 13% of every measured slack. The test's
# constants alone (R 0.25, mu about 0.02, confidence 0.95, validation share f 0.4, test
# fraction t 0.5) give about 33. Measured with each test at confidence 0.95: under the driver's
# run-level SLA (issue 46) iteration k tests at 1 - 0.05 * 6 / (pi^2 k^2), so c1 and c2 grow by
# their logarithms (ln(3 / eta) 4.8 -> 5.3 at k = 1, 6.7 at k = 2, 8.1 at k = 4); the simulator
# does not model it.
TAXI_ADASSP_DP_COST = 35.2


@dataclass(frozen=True)
class ValidationBoundComplexity:
    """Samples with which a pipeline is ACCEPTed at epsilon, from the shape of the SLAed loss
    test (validators/slaed.py) that decides the ACCEPT.

    The test ACCEPTs when its upper bound on the model's loss mu is under the target
    mu + gap. On n samples, a fraction t of them test points, the bound exceeds mu by about
        c1 / sqrt(n)       sampling (Bernstein): c1 = sqrt(2 R mu ln(3 / eta) / t), and
        c2 / (n eps)       the Laplace corrections: c2 = 2 R ln(3 / (2 eta)) / (f t),
    (R: loss bound, eta: the test's error share, f: the validation share of epsilon), so the
    pipeline needs the n that solves c1 / sqrt(n) + c2 / (n eps) = gap. Without DP that is
    n0 = (c1 / gap)^2, the power-law draw. Writing n = n0 y and a = dp_cost / (sqrt(n0) eps)
    with dp_cost = c2 / c1:  1 / sqrt(y) + a / y = 1, a quadratic in z = 1 / sqrt(y):
        a z^2 + z - 1 = 0,  z = (sqrt(1 + 4a) - 1) / (2a) = 2 / (1 + sqrt(1 + 4a)),
        n(eps) = n0 / z^2.
    DP adds about 2 dp_cost sqrt(n0) / eps samples (small a): the pipelines that need the most
    data pay relatively least for privacy, as Sage Fig. 5 measured. DP training's own noise is
    not in the form; on the taxi AdaSSP pipeline the measured slack fits it anyway
    (benchmarks/taxi_sample_complexity.py, TAXI_ADASSP_DP_COST)."""
    nonprivate_samples: float
    dp_cost: float = TAXI_ADASSP_DP_COST

    def samples_needed(self, epsilon: float) -> float:
        a = self.dp_cost / (math.sqrt(self.nonprivate_samples) * epsilon)
        z = 2.0 / (1.0 + math.sqrt(1.0 + 4.0 * a))  # the root's form without cancellation
        return self.nonprivate_samples / z ** 2


def fit_validation_bound(records, epsilons, slack) -> tuple[float, float, float]:
    """(c1, c2, largest relative error) of slack ~ c1 / sqrt(n) + c2 / (n eps) over measured
    iterations; the form is linear in (c1, c2), so least squares without intercept. c2 / c1 is
    ValidationBoundComplexity's dp_cost."""
    records, epsilons, slack = (np.asarray(x, dtype=float) for x in (records, epsilons, slack))
    design = np.column_stack([1 / np.sqrt(records), 1 / (records * epsilons)])
    (c1, c2), *_ = np.linalg.lstsq(design, slack, rcond=None)
    relative_error = np.abs(design @ np.array([c1, c2]) - slack) / slack
    return float(c1), float(c2), float(relative_error.max())


# How a pipeline's non-private sample complexity n0 becomes its curve n(epsilon).
COMPLEXITY_MODELS = {"inverse_epsilon": InverseEpsilonComplexity,
                     "taxi_measured": ValidationBoundComplexity}


@dataclass(frozen=True)
class WorkloadConfig:
    arrival_rate_per_hour: float
    samples_per_hour: int = 16_000  # Sage §5.4: about an hour of NYC taxi rides
    block_epsilon: float = 1.0
    block_delta: float = 1e-6
    arrival_hours: int = 400  # pipelines arrive during these hours ...
    drain_hours: int = 200  # ... and the simulation runs this much longer
    gamma_shape: float = 2.0
    # Power-law (Pareto) non-private sample complexities, truncated to [min, max].
    complexity_alpha: float = 1.5
    complexity_min_samples: float = 10_000
    complexity_max_samples: float = 2_000_000
    # A name in COMPLEXITY_MODELS, with its default parameters.
    complexity_model: str = "inverse_epsilon"
    initial_epsilon: float = 0.05
    min_request_epsilon: float = 0.01
    # Iterations a pipeline may run within one hour. Training time is not modelled below the
    # hour: a pipeline retries until it is released or must wait for new blocks.
    attempts_per_hour: int = 16

    def __post_init__(self):
        if not self.arrival_rate_per_hour > 0:
            raise ValueError(f"arrival rate must be > 0, got {self.arrival_rate_per_hour}")
        if self.complexity_model not in COMPLEXITY_MODELS:
            raise ValueError(f"unknown complexity model {self.complexity_model!r}; use one of "
                             f"{sorted(COMPLEXITY_MODELS)}")

    @property
    def horizon(self) -> int:
        return self.arrival_hours + self.drain_hours


@dataclass
class Pipeline:
    name: str
    arrival_hour: int
    complexity: SampleComplexity
    epsilon: float = 0.0
    window: int = 0  # blocks (query: samples) the next attempt needs at least
    released_hour: Optional[int] = None
    attempts: int = 0
    blocks: list[str] = field(default_factory=list)  # streaming: fresh blocks held
    resources: float = 0.0  # block_conserve: epsilon x blocks of its last RETRY

    def accepts(self, samples: float, epsilon: float) -> bool:
        return samples >= self.complexity.samples_needed(epsilon)


def draw_pipelines(config: WorkloadConfig, rng: np.random.Generator) -> list[Pipeline]:
    pipelines, time = [], 0.0
    scale = 1.0 / (config.arrival_rate_per_hour * config.gamma_shape)
    while True:
        time += rng.gamma(config.gamma_shape, scale)
        if time >= config.arrival_hours:
            return pipelines
        pareto = config.complexity_min_samples * (1.0 - rng.random()) ** (-1.0 / config.complexity_alpha)
        complexity = COMPLEXITY_MODELS[config.complexity_model](
            min(pareto, config.complexity_max_samples))
        pipelines.append(Pipeline(f"p{len(pipelines):05d}", int(time), complexity,
                                  config.initial_epsilon))


class Strategy:
    """How pipelines ask the ledger for budget; the ledger decides what is granted."""

    def __init__(self, ledger: BlockLedger, config: WorkloadConfig):
        self.ledger, self.config = ledger, config
        self.waiting: list[Pipeline] = []

    def new_block(self, hour: int) -> None:
        self.ledger.add_block(f"h{hour:06d}", epsilon=self.config.block_epsilon,
                              delta=self.config.block_delta)

    def arrive(self, pipeline: Pipeline) -> None:
        self.waiting.append(pipeline)

    def attempt(self, pipeline: Pipeline, hour: int) -> str:
        """One try: RELEASED, RETRY (budget spent, may try again) or WAIT (for new blocks)."""
        raise NotImplementedError

    def step(self, hour: int) -> None:
        for pipeline in list(self.waiting):
            for _ in range(self.config.attempts_per_hour):
                outcome = self.attempt(pipeline, hour)
                if outcome == RELEASED:
                    pipeline.released_hour = hour
                    self.waiting.remove(pipeline)
                    self.released(pipeline)
                if outcome != RETRY:
                    break

    def released(self, pipeline: Pipeline) -> None:
        pass

    def _grant(self, selector, epsilon: float, pipeline: Optional[str]) -> bool:
        try:
            self.ledger.request(selector, epsilon=epsilon, delta=0.0, pipeline=pipeline)
        except BudgetExhausted:
            return False
        return True


class QueryComposition(Strategy):
    STREAM = "stream"

    def new_block(self, hour: int) -> None:
        if hour == 0:  # one database, one budget, however much data arrives later
            self.ledger.add_block(self.STREAM, epsilon=self.config.block_epsilon,
                                  delta=self.config.block_delta)

    def attempt(self, pipeline: Pipeline, hour: int) -> str:
        samples = (hour + 1) * self.config.samples_per_hour
        if pipeline.window and samples < pipeline.window:
            return WAIT  # at its largest epsilon: waits until the data has doubled
        if self.ledger.block(self.STREAM).retired:
            return WAIT  # the stream's budget is gone for good
        if not self._grant(BlockIds([self.STREAM]), pipeline.epsilon, None):
            return WAIT
        if pipeline.accepts(samples, pipeline.epsilon):
            return RELEASED
        if pipeline.epsilon * 2 <= self.config.block_epsilon:
            pipeline.epsilon *= 2
        else:
            pipeline.window = 2 * samples
        return RETRY


class StreamingComposition(Strategy):

    def __init__(self, ledger: BlockLedger, config: WorkloadConfig):
        super().__init__(ledger, config)
        self.unused: list[str] = []

    def new_block(self, hour: int) -> None:
        super().new_block(hour)
        self.unused.append(f"h{hour:06d}")

    def attempt(self, pipeline: Pipeline, hour: int) -> str:
        epsilon = self.config.block_epsilon
        # Unused data goes to the oldest waiting pipeline first (step() visits them in order).
        while self.unused and not pipeline.accepts(
                len(pipeline.blocks) * self.config.samples_per_hour, epsilon):
            pipeline.blocks.append(self.unused.pop(0))
        samples = len(pipeline.blocks) * self.config.samples_per_hour
        if not pipeline.blocks or not pipeline.accepts(samples, epsilon):
            return WAIT
        return RELEASED if self._grant(BlockIds(pipeline.blocks), epsilon, None) else WAIT


class BlockStrategy(Strategy):
    """Block composition: pipelines register with the ledger, whose allocation policy splits
    each new block among the waiting ones, and finish when released."""
    POLICY: PolicyName  # the driver's policy the strategy retries by

    def __init__(self, ledger: BlockLedger, config: WorkloadConfig):
        super().__init__(ledger, config)
        self._live = None  # the ledger's live blocks, re-read after every change

    def new_block(self, hour: int) -> None:
        super().new_block(hour)
        self._live = None

    def arrive(self, pipeline: Pipeline) -> None:
        super().arrive(pipeline)
        self.ledger.register_pipeline(pipeline.name)
        self._live = None

    def released(self, pipeline: Pipeline) -> None:
        self.ledger.finish_pipeline(pipeline.name)
        self._live = None

    def _grant(self, selector, epsilon: float, pipeline: Optional[str]) -> bool:
        self._live = None
        return super()._grant(selector, epsilon, pipeline)

    def allowances(self, pipeline: Pipeline) -> list[float]:
        """Epsilon the pipeline may draw from each live block, newest first: its own
        reservation plus the block's free budget (allocation.available_to, epsilon part)."""
        if self._live is None:
            # A pipeline without a reservation on a block may draw its free budget,
            # available_to(block, None): read once per block, not once per pipeline.
            self._live = [(block, float(available_to(block, None)[0]))
                          for block in self.ledger.live_blocks()]
        return [float(available_to(block, pipeline.name)[0])
                if pipeline.name in block.reservations else free for block, free in self._live]

    def usable(self, allowances: list[float]) -> list[float]:
        """The allowances that pay the ledger's minimum request, largest first."""
        return sorted((a for a in allowances if a >= self.config.min_request_epsilon),
                      reverse=True)

    def train(self, pipeline: Pipeline, epsilon: float, allowances: list[float]) -> str:
        """Train on every block that can pay `epsilon` (Sage §6: "as much data as is available
        ..."), unless that is no more than the last RETRY had: then wait for more data."""
        window = sum(allowance >= epsilon for allowance in allowances)
        if window == 0 or window < pipeline.window:
            return WAIT
        if not self._grant(RecentWindow(window), epsilon, pipeline.name):
            return WAIT
        if pipeline.accepts(window * self.config.samples_per_hour, epsilon):
            return RELEASED
        self.next_request(pipeline, epsilon, window)
        return RETRY

    def next_request(self, pipeline: Pipeline, spent: float, window: int) -> None:
        """The driver's rule after a RETRY at `spent` on `window` blocks (after_retry): double
        epsilon on as many blocks (conserve, when the allocation can pay it), or double the
        data, waiting for new blocks."""
        epsilon, next_window = after_retry(
            self.POLICY, spent, window,
            lambda doubled: sum(allowance >= doubled for allowance in self.allowances(pipeline)))
        if next_window == window:
            pipeline.epsilon = epsilon
        pipeline.window = next_window


class BlockAggressive(BlockStrategy):
    POLICY = PolicyName.AGGRESSIVE

    def attempt(self, pipeline: Pipeline, hour: int) -> str:
        allowances = self.allowances(pipeline)
        usable = self.usable(allowances)
        if not usable:
            return WAIT
        window = max(range(1, len(usable) + 1), key=lambda w: (w * usable[w - 1], w))
        return self.train(pipeline, usable[window - 1], allowances)


class BlockConserve(BlockStrategy):
    POLICY = PolicyName.CONSERVE

    def attempt(self, pipeline: Pipeline, hour: int) -> str:
        allowances = self.allowances(pipeline)
        usable = self.usable(allowances)
        # At least `window` blocks, at the planned epsilon or at what that many blocks can pay.
        options = [(w, min(pipeline.epsilon, usable[w - 1]))
                   for w in range(max(pipeline.window, 1), len(usable) + 1)]
        if not options:
            return WAIT
        window, epsilon = max(options, key=lambda option: (option[0] * option[1], option[0]))
        if window * epsilon < 2 * pipeline.resources:
            return WAIT  # not yet twice what the last RETRY had
        return self.train(pipeline, epsilon, allowances)

    def next_request(self, pipeline: Pipeline, spent: float, window: int) -> None:
        pipeline.resources = spent * window
        super().next_request(pipeline, spent, window)


STRATEGY_CLASSES = {"query": QueryComposition, "streaming": StreamingComposition,
                    "block_aggressive": BlockAggressive, "block_conserve": BlockConserve}


@dataclass(frozen=True)
class WorkloadResult:
    strategy: str
    pipelines: int
    mean_release_hours: float
    unreleased_fraction: float
    ledger: BlockLedger


def simulate(strategy: str, config: WorkloadConfig, seed: int) -> WorkloadResult:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")
    pipelines = draw_pipelines(config, np.random.default_rng(seed))
    ledger = BlockLedger.create(":memory:", min_request_epsilon=config.min_request_epsilon)
    runner = STRATEGY_CLASSES[strategy](ledger, config)
    arriving = {}
    for pipeline in pipelines:
        arriving.setdefault(pipeline.arrival_hour, []).append(pipeline)
    for hour in range(config.horizon):
        runner.new_block(hour)
        for pipeline in arriving.get(hour, []):
            runner.arrive(pipeline)
        runner.step(hour)
    delays = [(p.released_hour if p.released_hour is not None else config.horizon) - p.arrival_hour
              for p in pipelines]
    unreleased = sum(p.released_hour is None for p in pipelines)
    return WorkloadResult(strategy, len(pipelines),
                          float(np.mean(delays)) if delays else math.nan,
                          unreleased / len(pipelines) if pipelines else math.nan, ledger)
