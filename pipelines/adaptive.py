"""Privacy-adaptive training (Sage §3.3): run one DP iteration after another until a model is
accepted, spending as little budget as the validator lets us.

One iteration is a TFX pipeline run (docs/architecture.md's data flow), on LocalDagRunner behind
the DAG guard (pipelines/local.run_local) and the ledger's own SQLite MLMD store, so every grant
is linked to the run that spent it:

    BlockLedger grant -> DPTransform -> [ObliviousSampleGen] -> DPTrainer -> SLAedValidator -> Pusher

The driver reads the SLAedValidator's ModelBlessing from MLMD and decides:

* ACCEPT: the Pusher pushed the model; the pipeline finishes and its reservations return.
* REJECT: the model cannot meet the target with this data; stop (nothing more is spent).
* RETRY: "conserve" (Sage §3.3) doubles epsilon if the pipeline's allocation can pay twice the
  epsilon on the same window, otherwise doubles the window, waiting for new blocks when the
  database has too few that can pay. "aggressive" spends all it may draw on the window at once
  and doubles the window on RETRY. Either stops when the stream has no more blocks to wait for
  or after `max_iterations` (TIMEOUT).

One SLA for the whole run. Sage's validator guarantees each test; a run that retries k times
tests k models, and with the same confidence at each test the chance that one of its decisions is
wrong grows with k. The driver gives iteration k's SLAedValidator `run_iteration=k`: its test
runs at 1 - (1 - confidence) 6 / (pi^2 k^2) (validators/slaed.py `iteration_confidence`, with the
derivation), so the run's ACCEPT (or REJECT) is wrong with probability at most
(1 - confidence) / 2 over all its iterations, the spec's confidence read as the run's. Each
ACCEPT states it: the blessing's `guarantee`, the driver's report and AdaptiveResult.message.

Tuning. With `IterationSpec.tuning` (DPTuner's parameters) and `Policy.tuning_share` f > 0, an
iteration may tune before it trains: its grant moves f of the training share to a "tuning" step
(policy.split_with_tuning), DPTuner runs a private selection there (components/dp_tuner) and
DPTrainer trains with the released best setting. The setting is public, so later iterations
train with it for free; policy.tune_next decides from the DP values released (the tuner's DP
score, the validator's DP metric and interval) whether an iteration tunes again.

Every iteration's grant charges (epsilon, delta) with the split declared once in the spec
({"transform": f1, "training": f2, "validation": f3}), recorded in its PrivacyGrant. Sage's
guarantee for the adaptive loop is the block ledger's: each block's filter admits a grant only
while the block's total stays within its ceiling, whatever the loop chose adaptively (Sage §4).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol

from tfx.components.pusher.component import Pusher
from tfx.orchestration import metadata, pipeline
from tfx.proto import pusher_pb2
from tfx.types import artifact_utils

from sage_tfx.components.block_example_gen import BlockExampleGen
from sage_tfx.components.block_ledger import BlockLedger as BlockLedgerComponent
from sage_tfx.choices import Choice
from sage_tfx.components.dp_trainer import DPTrainer, TrainerMode, preflight
from sage_tfx.components.dp_trainer import constants as model_keys
from sage_tfx.components.dp_trainer.parameters import DEFAULT_MODE, TUNABLE
from sage_tfx.components.dp_transform import DPTransform
from sage_tfx.components.dp_tuner import DPTuner
from sage_tfx.components.dp_tuner import executor as tuner_keys
from sage_tfx.components.dp_tuner.search_space import read_best_hyperparameters
from sage_tfx.components.dp_tuner.tuning import (DEFAULT_GRANT_STEP as TUNING_STEP,
                                                 SearchParameters, plan_search)
from sage_tfx.components.oblivious_sample_gen.component import ObliviousSampleGen
from sage_tfx.components.oblivious_sample_gen.accounting import COUNT_STEP
from sage_tfx.components.privacy_grant import Mechanism, step_events
from sage_tfx.components.util.user_module import is_module_path
from sage_tfx.pipelines.local import latest_run, run_local
from sage_tfx.pipelines.policy import (Policy, PolicyName, Tuned, after_retry, split_with_tuning,
                                       tune_next)
from sage_tfx.sage_access import BadRequest, BlockLedger, connect
from sage_tfx.sage_access.accounting import AccountingMode, check_split, split_share
from sage_tfx.sage_access.ledger import EXAMPLES
from sage_tfx.validators import constants as blessing_keys
from sage_tfx.validators.component import SLAedValidator
from sage_tfx.validators.slaed import Metric, Outcome

__all__ = ["AdaptiveResult", "BlockSource", "Iteration", "IterationSpec", "Policy", "RunOutcome",
           "build_iteration", "run_adaptive", "step_mechanisms"]


class RunOutcome(Choice):
    """How privacy-adaptive training ended (module docstring)."""
    ACCEPT = "ACCEPT"
    REJECT = "REJECT"
    TIMEOUT = "TIMEOUT"


ACCEPTED, REJECTED, TIMEOUT = RunOutcome.ACCEPT, RunOutcome.REJECT, RunOutcome.TIMEOUT


@dataclass(frozen=True)
class IterationSpec:
    """What one iteration runs. `trainer` holds DPTrainer's keyword arguments (mode, epochs, ...);
    `sampling` ObliviousSampleGen's (scheme, sample_size or gamma, epochs) for mode dp_sgd;
    `validation` SLAedValidator's (metric, target, confidence, loss_bound); in run_adaptive
    `confidence` is the whole run's (module docstring). `tuning` DPTuner's (tuner_fn, gamma,
    epochs, trials_mean, metric, ...), for iterations that tune (Policy.tuning_share)."""
    module_file: str
    trainer: Mapping
    validation: Mapping
    split: Mapping[str, float] = field(
        default_factory=lambda: {"transform": 0.1, "training": 0.6, "validation": 0.3})
    delta: float = 1e-7
    sampling: Optional[Mapping] = None
    seed: Optional[int] = None  # tests only: fixes the noise of every component
    tuning: Optional[Mapping] = None

    def check(self) -> None:
        """Refuse a spec that cannot run, before anything is charged."""
        if not (os.path.isfile(self.module_file) or is_module_path(self.module_file)):
            raise BadRequest(f"module file {self.module_file!r} does not exist")
        split = check_split(self.split)
        needed = {"transform", "training", "validation"}
        if self.sampling is not None and self.sampling.get("public_size") is None:
            needed.add(COUNT_STEP)  # ObliviousSampleGen pays its DP count of the records
        missing = needed - set(split)
        if missing:
            raise BadRequest(f"the split needs shares for {sorted(missing)}; got {dict(split)}")
        if self.tuning is not None:
            # policy.tune_next compares the tuner's DP score with the validator's DP metric,
            # ranked by the validator's metric: both must be the same metric.
            tuned, validated = (SearchParameters.of(self.tuning).metric,
                                Metric(self.validation["metric"]))
            if tuned != validated:
                raise BadRequest(f"the tuning's metric {tuned.value!r} differs from the "
                                 f"validator's {validated.value!r} (DPTuner defaults to "
                                 "accuracy): give `tuning` the validator's metric (and its "
                                 "loss_bound for a loss)")
        dp_sgd = (self.trainer.get("mode") or DEFAULT_MODE) == TrainerMode.DP_SGD
        if dp_sgd != (self.sampling is not None):
            raise BadRequest("mode dp_sgd trains on ObliviousSampleGen's samples: give `sampling` "
                             "for dp_sgd and only for dp_sgd")
        # The components check their own parameters when constructed (e.g. a target outside
        # what the metric can reach); build one DAG without running it.
        try:
            build_iteration(self, "check", "/nonexistent", "/nonexistent.sqlite", window=1,
                            epsilon=1.0, run_iteration=1,
                            tuning_share=0.5 if self.tuning is not None else 0.0)
        except BadRequest:
            raise
        except ValueError as error:
            raise BadRequest(f"the iteration's components refuse the spec: {error}") from error


def build_iteration(spec: IterationSpec, name: str, root: str, ledger_store: str, window: int,
                    epsilon: float, ledger_pipeline: Optional[str] = None,
                    metadata_config=None, ingest: Optional[BlockExampleGen] = None,
                    push_to: Optional[str] = None,
                    run_iteration: Optional[int] = None, tuning_share: float = 0.0,
                    setting: Optional[Mapping[str, float]] = None) -> pipeline.Pipeline:
    """The TFX pipeline of one iteration: a grant of (epsilon, spec.delta) on the `window` most
    recent blocks that can pay it, then transform, (sample,) train, validate, push (to
    `push_to`, default root/pushed). With `ingest`, new blocks are ingested first. With
    `run_iteration` k, it is iteration k of a privacy-adaptive run (the validator tests at
    iteration k's share of the run's confidence); without, its test stands alone. With
    `tuning_share` > 0 it tunes first (module docstring); else `setting` (a released best
    setting) overrides the trainer's learning_rate / l2_norm_clip."""
    seed = spec.seed
    grant = BlockLedgerComponent(ledger_store=ledger_store, epsilon=epsilon, delta=spec.delta,
                                 window=window, split=iteration_split(spec, tuning_share),
                                 step_mechanisms=step_mechanisms(spec),
                                 pipeline_name=ledger_pipeline or name,
                                 new_blocks=ingest.outputs["examples"] if ingest else None)
    examples, grant_channel = grant.outputs["examples"], grant.outputs["grant"]
    transform = DPTransform(examples=examples, grant=grant_channel, module_file=spec.module_file)
    components = ([ingest] if ingest else []) + [grant, transform]
    train_on = examples
    if spec.sampling is not None:
        sampler = ObliviousSampleGen(examples=examples, grant=grant_channel, seed=seed,
                                     **spec.sampling)
        components.append(sampler)
        train_on = sampler.outputs["samples"]
    trainer_options = {**spec.trainer, **(setting or {})}
    if tuning_share > 0:
        tuner = DPTuner(examples=examples, grant=grant_channel, module_file=spec.module_file,
                        transform_graph=transform.outputs["transform_graph"], seed=seed,
                        model_fn=spec.trainer.get("model_fn"),
                        **{name: spec.trainer.get(name) for name in TUNABLE},
                        **spec.tuning)
        components.append(tuner)
        trainer_options["hyperparameters"] = tuner.outputs["best_hyperparameters"]
    trainer = DPTrainer(examples=train_on, grant=grant_channel, module_file=spec.module_file,
                        transform_graph=transform.outputs["transform_graph"], seed=seed,
                        **trainer_options)
    validator = SLAedValidator(model=trainer.outputs["model"], examples=examples,
                               grant=grant_channel, module_file=spec.module_file,
                               transform_graph=transform.outputs["transform_graph"],
                               run_iteration=run_iteration, **spec.validation)
    pusher = Pusher(model=trainer.outputs["model"], model_blessing=validator.outputs["blessing"],
                    push_destination=pusher_pb2.PushDestination(
                        filesystem=pusher_pb2.PushDestination.Filesystem(
                            base_directory=push_to or os.path.join(root, "pushed"))))
    components += [trainer, validator, pusher]
    return pipeline.Pipeline(pipeline_name=name, pipeline_root=os.path.join(root, "runs"),
                             components=components, metadata_connection_config=metadata_config)


def iteration_split(spec: IterationSpec, tuning_share: float) -> dict:
    """The iteration's split: the spec's, or with tuning_share of training moved to tuning."""
    return (split_with_tuning(spec.split, tuning_share) if tuning_share > 0
            else dict(spec.split))


def step_mechanisms(spec: IterationSpec) -> dict[str, dict]:
    """What each step of the iteration runs, for the events its grant records."""
    mechanisms = {"transform": {"mechanism": Mechanism.LAPLACE},
                  "validation": {"mechanism": Mechanism.LAPLACE},
                  "training": {"mechanism": str(spec.trainer.get("mode") or DEFAULT_MODE)}}
    if spec.sampling and spec.sampling.get("public_size") is None:
        # ObliviousSampleGen's DP count of its records (discrete Laplace: pure epsilon-DP).
        mechanisms[COUNT_STEP] = {"mechanism": Mechanism.LAPLACE}
    return mechanisms


def _payable(ledger: BlockLedger, spec: IterationSpec, epsilon: float, pipeline: str,
             blocks: Optional[list] = None) -> list:
    """The blocks a grant of (epsilon, spec.delta) for this iteration would take now. An rdp
    ledger charges the RDP curve of the steps' events, so planning computes them too."""
    planned = {}
    if ledger.accounting.name == AccountingMode.RDP:
        planned = {"split": spec.split, "events": step_events(
            step_mechanisms(spec), check_split(spec.split), epsilon, spec.delta,
            AccountingMode.RDP)}
    return ledger.payable_window(epsilon, spec.delta, pipeline, blocks=blocks,
                                 data_format=EXAMPLES, **planned)


class BlockSource(Protocol):
    """New data for the database: `wait()` ingests the next block(s) and returns their ids,
    or an empty list when the stream has nothing more (the driver then times out)."""

    def wait(self) -> list[str]: ...

    def blocks_left(self) -> int: ...


@dataclass(frozen=True)
class Iteration:
    number: int
    window: int
    epsilon: float
    blocks: tuple[str, ...]
    outcome: Outcome
    dp_metric: float
    lower_bound: float
    upper_bound: float
    target: float
    confidence: float  # the level of this iteration's bounds (its share of the run's)
    guarantee: str  # the validator's statement of the run-level guarantee
    tuned: Optional[Tuned] = None  # what DPTuner released, when this iteration tuned


@dataclass
class AdaptiveResult:
    outcome: RunOutcome
    iterations: list[Iteration]
    pushed_model: Optional[str] = None
    message: str = ""

    @property
    def epsilon_spent(self) -> float:
        """Per block, at most: the sum of the iterations' epsilons (basic composition)."""
        return sum(iteration.epsilon for iteration in self.iterations)


def _largest_payable_epsilon(ledger: BlockLedger, window: int, spec: IterationSpec,
                             pipeline: str) -> float:
    """The most epsilon that `window` blocks can all pay for `pipeline` (0 if none)."""
    live = ledger.live_blocks()  # read once: the bisection below only plans
    high = max((b.epsilon_ceiling for b in live), default=0.0)
    low = ledger.min_request_epsilon
    if high <= 0 or len(_payable(ledger, spec, low, pipeline, blocks=live)) < window:
        return 0.0
    for _ in range(30):
        middle = (low + high) / 2
        payable = len(_payable(ledger, spec, middle, pipeline, blocks=live))
        low, high = (middle, high) if payable >= window else (low, middle)
    return low


def _latest_run_artifacts(store, pipeline_name: str) -> dict[str, list]:
    """The artifacts of the pipeline's most recent run, by type (LocalDagRunner runs
    synchronously, and the ledger registration keeps one driver per pipeline name)."""
    by_type: dict[str, list] = {}
    for artifact in store.get_artifacts_by_context(latest_run(store, pipeline_name).id):
        by_type.setdefault(artifact.type, []).append(artifact)
    if len(by_type.get("ModelBlessing", [])) != 1:
        raise RuntimeError(f"the last run of {pipeline_name!r} did not produce one ModelBlessing")
    return by_type


def _property(artifact, name: str) -> str:
    return artifact.custom_properties[name].string_value


def run_adaptive(spec: IterationSpec, policy: Policy, name: str, root: str, ledger_store: str,
                 source: BlockSource, report: Callable[[str], None] = print) -> AdaptiveResult:
    """Privacy-adaptive training of pipeline `name` on the ledger in the SQLite store
    `ledger_store` (also the TFX metadata store). See the module docstring."""
    spec.check()
    policy.check()
    ledger = BlockLedger(ledger_store)
    known = len(ledger.live_blocks())
    if policy.min_window > known + source.blocks_left():
        raise BadRequest(f"min_window {policy.min_window} is larger than the database will ever "
                         f"be: {known} live block(s) now and {source.blocks_left()} to come")
    ceiling = max((b.epsilon_ceiling for b in ledger.blocks()), default=0.0)
    if ledger.blocks() and policy.initial_epsilon > ceiling:
        raise BadRequest(f"initial_epsilon {policy.initial_epsilon} exceeds the blocks' ceiling "
                         f"{ceiling}: no block can ever pay the first iteration")
    store = connect(ledger_store)
    metadata_config = metadata.sqlite_metadata_connection_config(ledger_store)

    ledger.register_pipeline(name)
    iterations: list[Iteration] = []
    window, epsilon = policy.min_window, policy.initial_epsilon
    setting: Optional[dict] = None  # the last released best setting (public), carried
    tuning_share = policy.tuning_share if spec.tuning is not None else 0.0
    higher_is_better = Metric(spec.validation["metric"]) == Metric.ACCURACY
    try:
        while len(iterations) < policy.max_iterations:
            if policy.name == PolicyName.AGGRESSIVE:
                epsilon = _largest_payable_epsilon(ledger, window, spec, name)
            while epsilon <= 0 or len(_payable(
                    ledger, spec, max(epsilon, ledger.min_request_epsilon), name)) < window:
                arrived = source.wait()
                if not arrived:
                    return AdaptiveResult(TIMEOUT, iterations, message=(
                        f"the stream ran out: no {window} block(s) can pay epsilon {epsilon:g}"))
                report(f"  waiting for data: block {', '.join(arrived)} arrived")
                if policy.name == PolicyName.AGGRESSIVE:
                    epsilon = _largest_payable_epsilon(ledger, window, spec, name)
            tunes = tune_next(tuning_share, iterations[-1].tuned if iterations else None,
                              setting is not None, higher_is_better)
            share = tuning_share if tunes else 0.0
            preflight_iteration(spec, epsilon, iteration_split(spec, share))
            run_local(build_iteration(spec, name, root, ledger_store, window, epsilon,
                                      metadata_config=metadata_config,
                                      run_iteration=len(iterations) + 1, tuning_share=share,
                                      setting=setting), report=report)
            run_artifacts = _latest_run_artifacts(store, name)
            [blessing] = run_artifacts["ModelBlessing"]
            released = _tuned(run_artifacts.get("HyperParameters", [])) if tunes else None
            if released is not None:
                setting = released[0]
            grant_blocks = _grant_blocks(store, blessing)
            iteration = Iteration(
                number=len(iterations) + 1, window=window, epsilon=epsilon, blocks=grant_blocks,
                outcome=Outcome(_property(blessing, blessing_keys.OUTCOME)),
                dp_metric=float(_property(blessing, blessing_keys.DP_METRIC)),
                lower_bound=float(_property(blessing, blessing_keys.LOWER_BOUND)),
                upper_bound=float(_property(blessing, blessing_keys.UPPER_BOUND)),
                target=float(_property(blessing, blessing_keys.TARGET)),
                confidence=float(_property(blessing, blessing_keys.CONFIDENCE)),
                guarantee=_property(blessing, blessing_keys.GUARANTEE))
            if released is not None:
                iteration = dataclasses.replace(iteration, tuned=Tuned(
                    released[0], released[1], iteration.dp_metric, iteration.lower_bound,
                    iteration.upper_bound))
            iterations.append(iteration)
            metric = Metric(_property(blessing, blessing_keys.METRIC))
            report(_line(iteration, metric))
            if iteration.tuned is not None:
                report(f"  tuned first: best setting {dict(iteration.tuned.setting)} (DP "
                       f"{metric} {iteration.tuned.dp_score:.4g} on the tuner's held-out share)")
            if iteration.outcome == Outcome.ACCEPT:
                report(f"  guarantee: {iteration.guarantee}")
                return AdaptiveResult(ACCEPTED, iterations,
                                      _pushed(store, run_artifacts.get("PushedModel", [])),
                                      message=f"accepted; guarantee: {iteration.guarantee}")
            if iteration.outcome == Outcome.REJECT:
                # A loss is rejected from below (its lower bound exceeds the target), an
                # accuracy from above (its upper bound falls short of it).
                side, bound = (("at least", iteration.lower_bound) if metric == Metric.LOSS
                               else ("at most", iteration.upper_bound))
                return AdaptiveResult(REJECTED, iterations, message=(
                    f"the validator rejected the model: its {metric} is "
                    f"{side} {bound:.4g}, worse than the target "
                    f"{iteration.target:g} with this much data; guarantee: "
                    f"{iteration.guarantee}"))
            epsilon, window = after_retry(
                policy.name, epsilon, window,
                lambda doubled: len(_payable(ledger, spec, doubled, name)))
        return AdaptiveResult(TIMEOUT, iterations,
                              message=f"no ACCEPT after {policy.max_iterations} iterations")
    finally:
        ledger.finish_pipeline(name)


def _tuned(artifacts: list) -> Optional[tuple[dict, float]]:
    """(best setting, its DP score) from the run's HyperParameters artifact."""
    if not artifacts:
        return None
    [artifact] = artifacts
    return (read_best_hyperparameters(artifact.uri),
            float(_property(artifact, tuner_keys.DP_SCORE)))


def preflight_iteration(spec: IterationSpec, epsilon: float, split: Mapping) -> None:
    """Refuse, before the grant is charged, an iteration that DPTrainer would refuse after it,
    deciding only from public values (issue 16 §1: whether the driver goes on must not depend
    on the data). A block without Examples is never in the window: the driver plans, and the
    BlockLedger grants, windows of blocks holding Examples only (RecentWindow's data_format)."""
    try:
        preflight(spec.trainer, spec.sampling, epsilon, spec.delta, check_split(split))
    except ValueError as error:
        raise BadRequest(f"DP-SGD cannot train at epsilon {epsilon:g} (its grant step's share); "
                         f"nothing was charged for it: {error}") from error
    if TUNING_STEP in split:
        # The search's calibration on its share: Papernot-Steinke's selection adds a fixed RDP
        # overhead (ln E[K], ln 1/gamma terms), so a small tuning share cannot pay for it.
        try:
            plan_search(SearchParameters.of(spec.tuning),
                        *split_share(epsilon, spec.delta, check_split(split), TUNING_STEP))
        except ValueError as error:
            raise BadRequest(f"DPTuner cannot tune at epsilon {epsilon:g} (its grant step's "
                             f"share); nothing was charged for it: {error}") from error


def _line(iteration: Iteration, metric: Metric) -> str:
    span = f"{iteration.blocks[-1]}..{iteration.blocks[0]}" if iteration.blocks else "-"
    return (f"iteration {iteration.number}: window {iteration.window} block(s) ({span}), "
            f"epsilon {iteration.epsilon:.4g} -> {iteration.outcome}  (DP {metric} "
            f"{iteration.dp_metric:.4g}; with confidence {iteration.confidence:.4g} it is in "
            f"[{iteration.lower_bound:.4g}, {iteration.upper_bound:.4g}]; target "
            f"{iteration.target:g})")


def _grant_blocks(store, blessing) -> tuple[str, ...]:
    model_id = blessing.custom_properties[blessing_keys.CURRENT_MODEL_ID].int_value
    [model] = store.get_artifacts_by_id([model_id])
    return tuple(json.loads(model.custom_properties[model_keys.BLOCKS].string_value))


def _pushed(store, pushed_models: list) -> Optional[str]:
    """Where TFX's Pusher pushed this run's model (None if it pushed nothing)."""
    pushed = [a for a in pushed_models
              if a.custom_properties.get("pushed") and a.custom_properties["pushed"].int_value]
    if not pushed:
        return None
    artifact = artifact_utils.deserialize_artifact(store.get_artifact_type("PushedModel"),
                                                   pushed[0])
    return artifact.get_string_custom_property("pushed_destination")
