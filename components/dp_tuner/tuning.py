"""The DP search: private selection (mechanisms/private_selection.py) over DP-SGD trials run by
DPTrainer's training code (dp_trainer/dp_sgd.train), each scored by the SLAed validator's DP
mean release (validators/slaed.DPMeanRelease) on a held-out share.

The mechanism, on the n records of the grant's training split (decoded as DPTrainer decodes):
1. Held-out share: each record goes to the held-out part with public probability h, by a bit
   drawn once per search from the secret generator, independently of the data.
   (K and the candidates come from a generator of their own: module docstring of `search`.)
2. Normaliser: n_hat = the training part's size + DiscreteLaplace(1 / eps_count)
   (ObliviousSampleGen's dp_count, sensitivity 1, pure eps_count). It only scales the update
   (DP-SGD divides by gamma * n_hat, a public number once released): post-processing.
3. Private selection of the best of K trials, K ~ the truncated negative binomial law
   (shape eta, E[K] = `trials_mean`), drawn from the secret generator before any trial: K
   depends on no record, and no record can stop the loop early (DP-SGD's failures are decided
   on public stand-ins before the charge; a NaN score ranks last). A trial Q:
   a. draws a candidate uniformly (inside private_selection);
   b. trains the search's model from its initial weights with DP-SGD (dp_sgd.RepeatedTraining:
      the model is built and the step traced once per search, before any trial; a trial
      resets the weights and feeds its settings as variables): `steps` = epochs *
      round(1 / gamma) steps, each on a
      Poisson sample of the training part (every training record in with probability gamma, a
      fresh draw per step and per trial). Every step reads all n rows and masks the others
      (weight 0: zero gradient), so the rows read are public and nothing is truncated or
      routed: the step is exactly the Poisson-subsampled Gaussian, under add-or-remove-one,
      whatever the data: event SelfComposed(PoissonSampled(gamma, Gaussian(sigma)), steps).
      The clip norm (a candidate's) scales noise and signal alike: the event does not move.
   c. releases its score: the DP mean of the held-out part's per-example metric (correct
      prediction, or loss clipped to [0, B]) by DPMeanRelease (Laplace count and sum at
      eps_score / 2 each).
   Q's event is the composition of (b) and (c) (a record is in one part, so this counts it
   twice: conservative), the same for every candidate, as the selection requires.
   The search's event: Compose(count, RepeatAndSelect(Q's event, E[K], eta)).
   Fresh randomness: each trial draws its own samples, noise and candidate; the held-out bits,
   n_hat and the initial weights are shared, but all are drawn before the trials,
   independently of them, so conditional on them the trials are i.i.d. as Papernot-Steinke's
   Theorem 2 assumes; the held-out bits and the initial weights (build_model's, public) are
   data-independent, so averaging over them keeps the bound (a mixture of
   mechanisms each satisfying a Renyi bound under the same coupled neighbours satisfies it:
   Renyi divergence is jointly quasi-convex).
4. Released: the best candidate and its DP score only; K, the other trials, their scores and
   candidates, n_hat and the held-out size are written and logged nowhere, and nothing is
   logged, warned or printed while the search runs (`_silenced`: the log cannot count the
   trials). A trial creates no model, layer or traced function, and calls the compiled step
   as a concrete function, which TensorFlow's retracing detector does not count (dp_sgd.
   make_dp_step): the Keras name counters and the detector are left as one trial leaves them,
   so the next component in the process cannot count the trials there either. TensorFlow's
   process-wide uid counter, which every eager op advances and from which a SavedModel written
   later in the same process numbers its functions, is K's all the same: so the executor runs
   `search` in a process of its own, which returns the best and its score only
   (search_process.py).

Calibration: the noise multiplier sigma is the smallest (dp-accounting's calibrate_dp_mechanism)
whose search event spends at most the step's (epsilon, delta) by the RDP accountant; with no
truncation or routing there is no delta outside the event, so an rdp ledger charges the event's
curve and a basic ledger the share. The plan reads public parameters only, so the BlockLedger's
preflight makes it before the charge (and refuses a share too small) and privacy_grant records
its event for the step.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
from dp_accounting import dp_event, mechanism_calibration, rdp
from scipy import optimize

from sage_tfx.components.dp_trainer.calibrate import (DEFAULT_MAX_NOISE_MULTIPLIER,
                                                      CalibrationError)
from sage_tfx.components.oblivious_sample_gen.accounting import RDP_ORDERS
from sage_tfx.mechanisms.private_selection import TruncatedNegativeBinomial, private_selection
from sage_tfx.mechanisms.release import Release
from sage_tfx.randomness import secret_rng
from sage_tfx.sage_access.accounting import pure_dp_event
from sage_tfx.sage_access.errors import BadRequest
from sage_tfx.validators.slaed import Metric

DEFAULT_GRANT_STEP = "tuning"
# Public defaults: the fractions of the step's epsilon for the normaliser's count and for each
# trial's score (the rest pays for the trials' DP-SGD), the held-out probability, and the law
# of K (geometric, E[K] = 4).
DEFAULTS = {"gamma": 0.05, "epochs": 2, "trials_mean": 4.0, "trials_shape": 1.0,
            "holdout_fraction": 0.3, "count_fraction": 0.05, "score_fraction": 0.1}
_MIN_NOISE_MULTIPLIER = 0.1


@dataclass(frozen=True)
class SearchParameters:
    """DPTuner's public parameters (DEFAULTS); `metric` accuracy or loss (with `loss_bound`)."""
    gamma: float
    epochs: int
    trials_mean: float
    trials_shape: float
    holdout_fraction: float
    count_fraction: float
    score_fraction: float
    metric: str = Metric.ACCURACY
    loss_bound: Optional[float] = None
    max_noise_multiplier: Optional[float] = None

    @classmethod
    def of(cls, given: Mapping) -> "SearchParameters":
        """From DPTuner's parameters (None: the default), checked: BadRequest naming a bad one."""
        values = {name: given.get(name) if given.get(name) is not None else default
                  for name, default in DEFAULTS.items()}
        for name in ("gamma", "holdout_fraction", "count_fraction", "score_fraction"):
            if not 0.0 < float(values[name]) < 1.0:
                raise BadRequest(f"DPTuner's {name} must lie in (0, 1), got {values[name]!r}")
        if values["count_fraction"] + values["score_fraction"] >= 1.0:
            raise BadRequest("count_fraction + score_fraction must leave a share for training")
        if not (float(values["epochs"]) == int(values["epochs"]) and int(values["epochs"]) >= 1):
            raise BadRequest(f"DPTuner's epochs must be a positive integer, got {values['epochs']!r}")
        if not float(values["trials_mean"]) > 1.0 or not float(values["trials_shape"]) >= 0.0:
            raise BadRequest("the law of the number of trials needs trials_mean > 1 and "
                             f"trials_shape >= 0, got {values['trials_mean']!r}, "
                             f"{values['trials_shape']!r}")
        try:
            metric = Metric.parse(given.get("metric") or Metric.ACCURACY, "metric")
        except ValueError as error:
            raise BadRequest(str(error)) from None
        loss_bound = given.get("loss_bound")
        if metric == Metric.LOSS and not (loss_bound is not None and float(loss_bound) > 0):
            raise BadRequest("metric 'loss' needs a positive loss_bound (the clip of each "
                             "held-out loss: the score's sensitivity)")
        return cls(float(values["gamma"]), int(values["epochs"]), float(values["trials_mean"]),
                   float(values["trials_shape"]), float(values["holdout_fraction"]),
                   float(values["count_fraction"]), float(values["score_fraction"]), metric,
                   None if loss_bound is None else float(loss_bound),
                   given.get("max_noise_multiplier"))

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(1.0 / self.gamma))

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def law(self) -> TruncatedNegativeBinomial:
        """The truncated negative binomial of shape eta whose mean is trials_mean: E[K] falls
        from +inf to 1 as gamma rises through (0, 1), so the root is unique."""
        gamma = optimize.brentq(
            lambda g: TruncatedNegativeBinomial(self.trials_shape, g).mean - self.trials_mean,
            1e-12, 1.0 - 1e-12, xtol=1e-15)
        return TruncatedNegativeBinomial(self.trials_shape, float(gamma))

    @property
    def value_range(self) -> float:
        return 1.0 if self.metric == Metric.ACCURACY else float(self.loss_bound)

    def as_mechanism(self) -> dict:
        """The step's entry in a grant's step_mechanisms (privacy_grant.planned_event)."""
        return {"mechanism": "dp_tuning", **{name: getattr(self, name) for name in (
            *DEFAULTS, "metric", "loss_bound", "max_noise_multiplier")}}


def score_event(epsilon: float) -> dp_event.DpEvent:
    """The event of DPMeanRelease at `epsilon` (mechanisms.laplace_count_and_sum's: a Laplace
    count and a Laplace sum at epsilon / 2 each, in units of their sensitivities)."""
    half = dp_event.LaplaceDpEvent(noise_multiplier=1.0 / (epsilon / 2.0))
    return dp_event.ComposedDpEvent([half, half])


@dataclass(frozen=True)
class SearchPlan:
    parameters: SearchParameters
    noise_multiplier: float
    count_epsilon: float
    score_epsilon: float
    trial_event: dp_event.DpEvent
    event: dp_event.DpEvent  # the whole search's: what the grant step records and charges
    epsilon: float  # accounted at the step's delta (<= the share)


def _events(parameters: SearchParameters, law: TruncatedNegativeBinomial, count_epsilon: float,
            score_epsilon: float, noise_multiplier: float):
    trial = dp_event.ComposedDpEvent([dp_sgd_event(parameters, noise_multiplier),
                                      score_event(score_epsilon)])
    return trial, dp_event.ComposedDpEvent([pure_dp_event(count_epsilon),
                                            law.selection_event(trial)])


def _accounted(event: dp_event.DpEvent, delta: float) -> float:
    accountant = rdp.RdpAccountant(list(RDP_ORDERS))
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=64)
def plan_search(parameters: SearchParameters, epsilon: float, delta: float) -> SearchPlan:
    """The noise and events of a search on an (epsilon, delta) share (module docstring);
    CalibrationError (a BadRequest) when the share cannot pay for it. A few seconds of RDP
    accounting (the selection's bound at every order), made by the grant's planning, the
    BlockLedger's preflight and the executor alike: kept per process (a pure function of public
    values)."""
    if not epsilon > 0 or not 0.0 < delta < 1.0:
        raise CalibrationError(f"DPTuner needs epsilon > 0 and delta in (0, 1), got "
                               f"({epsilon}, {delta})")
    law = parameters.law
    count_epsilon = parameters.count_fraction * epsilon
    score_epsilon = parameters.score_fraction * epsilon
    most = float(parameters.max_noise_multiplier or DEFAULT_MAX_NOISE_MULTIPLIER)

    def event_at(noise_multiplier: float):
        return _events(parameters, law, count_epsilon, score_epsilon, noise_multiplier)[1]

    if _accounted(event_at(most), delta) > epsilon:
        raise CalibrationError(
            f"(epsilon={epsilon:g}, delta={delta:g}) cannot pay for a search of E[K] = "
            f"{parameters.trials_mean:g} trials of {parameters.steps} DP-SGD steps: even noise "
            f"multiplier {most:g} spends more. Give the tuning step more budget, or tune with "
            "fewer epochs or fewer expected trials.")
    if _accounted(event_at(_MIN_NOISE_MULTIPLIER), delta) <= epsilon:
        noise_multiplier = _MIN_NOISE_MULTIPLIER
    else:
        noise_multiplier = float(mechanism_calibration.calibrate_dp_mechanism(
            lambda: rdp.RdpAccountant(list(RDP_ORDERS)), event_at, epsilon, delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(
                _MIN_NOISE_MULTIPLIER, most)))
    trial, event = _events(parameters, law, count_epsilon, score_epsilon, noise_multiplier)
    return SearchPlan(parameters, noise_multiplier, count_epsilon, score_epsilon, trial, event,
                      _accounted(event, delta))


@dataclass(frozen=True)
class Best:
    """What a search releases: the best candidate's settings and its DP score."""
    settings: dict[str, float]
    score: float


def select_best(candidates: Sequence[Mapping[str, float]], run_trial: Callable[[int], Release],
                trial_event: dp_event.DpEvent, law, rng: np.random.Generator,
                higher_is_better: bool = True) -> tuple[Best, dp_event.DpEvent]:
    """Private selection (private_selection.py) among `candidates`, keeping the best output
    only: (its settings and DP score, the selection's event). `run_trial(index)` releases the
    candidate's DP metric; for a loss (higher_is_better False) the selection ranks its negation
    and the released score is the loss again (post-processing). The audit adapter
    (audit/mechanisms.dp_tuner_outputs) runs this function."""
    sign = 1.0 if higher_is_better else -1.0

    def ranked(index: int) -> Release:
        release = run_trial(index)
        return Release(sign * float(np.asarray(release.value).reshape(())), release.event,
                       release.additional_delta)

    release = private_selection(len(candidates), ranked, trial_event, law, rng)
    selected = release.value  # never None: the truncated negative binomial has K >= 1
    return Best(dict(candidates[selected.candidate]), sign * selected.score), release.event


class PoissonWeights:
    """A trial's StepPlan.weights: step j's weights (1 for a training record in step j's
    Poisson sample, each with probability gamma independently, else 0), drawn from `rng` when
    run_steps reads weights[j], in step order. The same law as drawing every step's at once,
    in memory for one step (n floats) instead of steps x n (8 GB of uniforms at gamma 0.01,
    5 epochs, 2M rows): memory that grew with n and the steps was a cost, not a release, but
    one a search could fail on after the charge."""

    def __init__(self, rng: np.random.Generator, training: np.ndarray, gamma: float):
        self._rng, self._training, self._gamma = rng, training, gamma
        self._next = 0

    def __getitem__(self, step: int) -> np.ndarray:
        if step != self._next:  # each step's draw is fresh: read once, in order
            raise IndexError(f"step {step}'s weights read out of order (next: {self._next})")
        self._next += 1
        return ((self._rng.random(len(self._training)) < self._gamma)
                & self._training).astype(np.float32)


def search(module, inputs, labels, candidates: Sequence[Mapping[str, float]], plan: SearchPlan,
           seed: Optional[int] = None) -> tuple[Best, dp_event.DpEvent]:
    """The search of the module docstring on decoded `inputs` (a tensor or a dict of them) and
    `labels` of the n granted training records; each candidate names every TUNABLE setting.
    Returns the best and the event that ran (the plan's, checked).

    Two secret generators: one draws K and the candidates only, the other the held-out bits,
    the Poisson samples and (seeded) the noise keys. So K and the candidates tried are the same
    on every dataset for the same seed, not only the same in law (tests check it on
    neighbours). `seed` (tests only) fixes both and DP-SGD's noise."""
    import tensorflow as tf

    from sage_tfx.components.dp_trainer import dp_sgd
    from sage_tfx.components.oblivious_sample_gen.executor import dp_count
    from sage_tfx.validators.executor import per_example_metric
    from sage_tfx.validators.slaed import DPMeanRelease, _bounded_losses

    parameters = plan.parameters
    selection_rng = secret_rng(seed)
    rng = secret_rng(None if seed is None else seed + 1)
    n = int(labels.shape[0])
    held_out = rng.random(n) < parameters.holdout_fraction
    training = ~held_out
    n_hat = dp_count(int(training.sum()), plan.count_epsilon)
    normaliser = parameters.gamma * max(n_hat, 1)
    rows = np.broadcast_to(np.arange(n, dtype=np.int32), (parameters.steps, n))
    labels_array = labels.numpy()

    def held_out_sum(model) -> float:
        """The held-out share's sum of the per-example metric (bounded losses for a loss). With
        no record (n = 0) the sum is 0 like any empty sum, and the score is released the same
        way (Laplace noise on a count of 0): per_example_metric needs at least one row."""
        if n == 0:
            return 0.0
        outputs = np.concatenate([
            model(dp_sgd.gather_rows(inputs, tf.range(start, min(start + 4096, n))),
                  training=False).numpy()
            for start in range(0, n, 4096)])
        values = per_example_metric(parameters.metric, module, labels_array, outputs)
        if parameters.metric == Metric.LOSS:
            values = _bounded_losses(values, parameters.value_range)
        return float(values[held_out].sum())

    def run_trial(index: int) -> Release:
        settings = candidates[index]
        config = dp_sgd.DPSGDConfig(plan.noise_multiplier, settings["l2_norm_clip"],
                                    settings["learning_rate"])
        noise_seed = None if seed is None else int(rng.integers(2 ** 31))
        step_plan = dp_sgd.StepPlan(rows, PoissonWeights(rng, training, parameters.gamma),
                                    normaliser, parameters.epochs)
        trials.train(step_plan, config, seed=noise_seed)
        release = DPMeanRelease.of_sum(int(held_out.sum()), held_out_sum(model),
                                       parameters.value_range, plan.score_epsilon)
        return Release(release.dp_mean, dp_event.ComposedDpEvent(
            [dp_sgd_event(parameters, plan.noise_multiplier), release.event]))

    with _silenced():
        # One model and one traced step for the whole search (module docstring, 3b and 4).
        model = module.build_model()
        trials = dp_sgd.RepeatedTraining(model, module.training_loss(model), inputs, labels)
        best, event = select_best(candidates, run_trial, plan.trial_event, parameters.law,
                                  selection_rng,
                                  higher_is_better=parameters.metric == Metric.ACCURACY)
    if event != plan.event.events[1]:
        raise RuntimeError("the selection ran another event than the plan's; nothing released")
    return best, plan.event


@contextlib.contextmanager
def _silenced():
    """Nothing logged, warned or printed while the search runs. A trial traces and builds
    nothing (module docstring, 4), but code runs once per trial that may log, warn or print,
    once per trial or once at the n-th: the user's loss() and predicted_class (the score's
    per-example metric), TensorFlow's C++ runtime (its allocator warns of the first few
    allocations above a tenth of free memory), numpy's warnings. A log whose length or content
    depends on K would release the secret K. So for the search's duration every Python logging
    record (any logger, any level: logging.disable) and warning is dropped, and so is every
    write to sys.stdout / sys.stderr and to file descriptors 1 and 2 (TensorFlow's C++ log):
    what the search leaves there is the same for every K. Process-wide for that time: the
    executor runs nothing else meanwhile. An exception still propagates (raised, not logged)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    with contextlib.ExitStack() as stack:
        stack.callback(logging.disable, previous)
        discarded = stack.enter_context(open(os.devnull, "w"))
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            getattr(sys, stream).flush()
            saved = os.dup(fd)
            stack.callback(os.close, saved)
            stack.callback(os.dup2, saved, fd)
            stack.callback(getattr(sys, stream).flush)  # the search's writes go to devnull
            os.dup2(discarded.fileno(), fd)
        stack.enter_context(contextlib.redirect_stdout(discarded))
        stack.enter_context(contextlib.redirect_stderr(discarded))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        yield


def dp_sgd_event(parameters: SearchParameters, noise_multiplier: float) -> dp_event.DpEvent:
    """One trial's DP-SGD event (module docstring, 3b)."""
    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(parameters.gamma,
                                       dp_event.GaussianDpEvent(noise_multiplier)),
        parameters.steps)
