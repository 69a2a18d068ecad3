"""DPTrainer component: DP-SGD on oblivious samples (or AdaSSP linear regression), with noise
calibrated to the grant's training share."""
from __future__ import annotations

from typing import Optional

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec, standard_artifacts

from sage_tfx.components.block_ledger import preflight
from sage_tfx.components.block_ledger.component import (check_before_charge,
                                                        refuse_seed_before_charge)
from sage_tfx.components.dag_guard import PrivateExamples
from sage_tfx.components.dp_trainer import executor
from sage_tfx.components.dp_trainer.parameters import (DEFAULT_GRANT_STEP, DEFAULT_MODE,
                                                       TUNABLE, TrainerMode, module_needs)
from sage_tfx.components.oblivious_sample_gen.component import ObliviousSampleGen
from sage_tfx.components.privacy_grant import PrivacyGrant


class DPTrainerSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "module_file": component_spec.ExecutionParameter(type=str),
        "model_fn": component_spec.ExecutionParameter(type=str, optional=True),
        "mode": component_spec.ExecutionParameter(type=str),
        "grant_step": component_spec.ExecutionParameter(type=str),
        "epochs": component_spec.ExecutionParameter(type=int, optional=True),
        "l2_norm_clip": component_spec.ExecutionParameter(type=float, optional=True),
        "learning_rate": component_spec.ExecutionParameter(type=float, optional=True),
        "max_noise_multiplier": component_spec.ExecutionParameter(type=float, optional=True),
        "feature_bound": component_spec.ExecutionParameter(type=float, optional=True),
        "label_bound": component_spec.ExecutionParameter(type=float, optional=True),
        "label_offset": component_spec.ExecutionParameter(type=float, optional=True),
        "encryption_key_env": component_spec.ExecutionParameter(type=str, optional=True),
        "seed": component_spec.ExecutionParameter(type=int, optional=True),
    }
    INPUTS = {
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
        "transform_graph": component_spec.ChannelParameter(
            type=standard_artifacts.TransformGraph, optional=True),
        # TFX's Trainer input of the name: DPTuner's (or TFX's Tuner's) best_hyperparameters.
        "hyperparameters": component_spec.ChannelParameter(
            type=standard_artifacts.HyperParameters, optional=True),
    }
    OUTPUTS = {
        "model": component_spec.ChannelParameter(type=standard_artifacts.Model),
        "model_run": component_spec.ChannelParameter(type=standard_artifacts.ModelRun),
    }


class DPTrainer(base_component.BaseComponent):
    """Trains the model of `module_file` (see components/util/user_module.py) under the grant's
    `grant_step` share of (epsilon, delta). `model_fn` names the module's function that builds
    the Keras model (default build_model; a TFX module's, e.g. "_build_keras_model"; its
    `run_fn` is not called).

    `hyperparameters` (optional) is a HyperParameters artifact, as TFX's Trainer takes it:
    DPTuner's best_hyperparameters (or TFX's Tuner's file format): its values of
    `learning_rate` and `l2_norm_clip` replace the parameters of those names (which may then be
    left out); another name in it is refused before any record is read.

    mode 'dp_sgd': `examples` are ObliviousSampleGen's samples; the noise multiplier is
    calibrated so that the accounted (epsilon, delta) of the sampling that ran, for the steps
    that will run (`epochs`, default all the samples hold), equals the share; it refuses to
    start if that needs a noise multiplier above `max_noise_multiplier`.
    mode 'adassp': `examples` are the granted Examples; DP linear regression with public
    bounds `feature_bound` (row norm, intercept included) and `label_bound` (on the label minus
    the public `label_offset`, default 0, toward which the ridge shrinks predictions).

    Outputs a Model (SavedModel under Format-Serving with the signatures a TFX run_fn exports:
    `serving_default` over serialized raw tf.Examples, and with a transform graph
    `transform_features`; custom properties dp_epsilon, dp_delta, noise_multiplier,
    l2_norm_clip, steps, sampling_scheme, blocks, grant_id) and a ModelRun with TensorBoard
    logs (the epsilon spent after each epoch, public; the training loss is not DP and is
    written nowhere).

    The BlockLedger that grants `grant` checks, before it charges, what this trainer would
    refuse after it (block_ledger/preflight.py): the module loads and defines what `mode`
    needs, Keras 2 for DP-SGD, the model and loss on public stand-in batches (one DP-SGD step
    included, dp_trainer/stand_in.py), and DP-SGD's calibration under Poisson sampling. `seed`
    (tests only) is refused there too unless the ledger was created for tests.
    """

    SPEC_CLASS = DPTrainerSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, examples: channel.Channel, grant: channel.Channel, module_file: str,
                 mode: str = DEFAULT_MODE, grant_step: str = DEFAULT_GRANT_STEP,
                 epochs: Optional[int] = None,
                 l2_norm_clip: Optional[float] = None, learning_rate: Optional[float] = None,
                 max_noise_multiplier: Optional[float] = None,
                 feature_bound: Optional[float] = None, label_bound: Optional[float] = None,
                 label_offset: Optional[float] = None,
                 transform_graph: Optional[channel.Channel] = None,
                 encryption_key_env: Optional[str] = None, seed: Optional[int] = None,
                 model_fn: Optional[str] = None,
                 hyperparameters: Optional[channel.Channel] = None):
        mode = TrainerMode.parse(mode, "trainer mode")
        needed = (("l2_norm_clip", l2_norm_clip), ("learning_rate", learning_rate)) \
            if mode == TrainerMode.DP_SGD \
            else (("feature_bound", feature_bound), ("label_bound", label_bound))
        # The hyperparameters' values (learning_rate, l2_norm_clip) arrive at run time.
        missing = [name for name, value in needed if value is None
                   and not (hyperparameters is not None and name in TUNABLE)]
        if missing:
            raise ValueError(f"mode {mode.value!r} needs {missing}")
        super().__init__(spec=DPTrainerSpec(
            module_file=module_file, model_fn=model_fn, mode=mode, grant_step=grant_step,
            epochs=epochs,
            l2_norm_clip=l2_norm_clip, learning_rate=learning_rate,
            max_noise_multiplier=max_noise_multiplier, feature_bound=feature_bound,
            label_bound=label_bound, label_offset=label_offset,
            encryption_key_env=encryption_key_env, seed=seed,
            examples=examples, grant=grant, transform_graph=transform_graph,
            hyperparameters=hyperparameters,
            model=channel.Channel(type=standard_artifacts.Model),
            model_run=channel.Channel(type=standard_artifacts.ModelRun)))
        sampler = (examples.producer_component if isinstance(examples, channel.OutputChannel)
                   else None)
        sampling = ({name: sampler.exec_properties.get(name) for name in ("scheme", "gamma",
                                                                           "epochs")}
                    if isinstance(sampler, ObliviousSampleGen) else None)
        if seed is not None:
            refuse_seed_before_charge(grant, f"DPTrainer seed {seed}")
        check_before_charge(grant, preflight.Check(
            component="DPTrainer", module_file=module_file, purpose=mode,
            module_needs=module_needs(mode, transform_graph is not None),
            legacy_keras=mode == TrainerMode.DP_SGD,
            trainer={"mode": mode, "model_fn": model_fn, "grant_step": grant_step,
                     "epochs": epochs,
                     "max_noise_multiplier": max_noise_multiplier,
                     "transform_graph": transform_graph is not None},
            sampling=sampling))
