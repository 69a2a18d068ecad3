"""The privacy-adaptive driver's tuning rule (pipelines/policy.py tune_next, split_with_tuning)."""
import pytest

from sage_tfx.pipelines.policy import Policy, Tuned, split_with_tuning, tune_next
from sage_tfx.sage_access.accounting import check_split
from sage_tfx.sage_access.errors import BadRequest


def test_the_first_iteration_tunes_and_a_confirmed_setting_is_carried_for_free():
    assert not tune_next(0.0, None, False, True)  # tuning off
    assert tune_next(0.25, None, False, True)  # nothing known yet
    # Accuracy: the tuner scored the setting 0.90; the model trained with it reached 0.88, with
    # interval [0.85, 0.91] (half-width 0.03): within it, confirmed; the share goes to training.
    confirmed = Tuned({"learning_rate": 0.5}, 0.90, 0.88, 0.85, 0.91)
    assert not tune_next(0.25, confirmed, True, True)
    # Carried from an earlier iteration (the last one did not tune): no tuning.
    assert not tune_next(0.25, None, True, True)
    # The model fell short of the tuner's score by more than the half interval: tune again.
    assert tune_next(0.25, Tuned({"learning_rate": 0.5}, 0.90, 0.80, 0.77, 0.83), True, True)
    # A loss: short means the model's loss exceeds the tuner's score.
    assert tune_next(0.25, Tuned({"learning_rate": 0.5}, 0.20, 0.40, 0.35, 0.45), True, False)
    assert not tune_next(0.25, Tuned({"learning_rate": 0.5}, 0.40, 0.20, 0.15, 0.25), True,
                         False)


def test_the_tuning_share_comes_out_of_training_exactly():
    split = split_with_tuning({"transform": 0.1, "training": 0.6, "validation": 0.3}, 0.25)
    assert split == {"transform": "0.1", "training": "0.450", "validation": "0.3",
                     "tuning": "0.150"}
    check_split(split)  # sums to exactly 1
    with pytest.raises(BadRequest, match="tuning_share"):
        Policy(tuning_share=1.0).check()


def _spec(**tuning):
    import dataclasses

    from sage_tfx.examples.taxi.pipeline import dp_sgd_spec

    return dataclasses.replace(dp_sgd_spec(), tuning={"gamma": 0.02, "epochs": 1,
                                                      "metric": "loss", "loss_bound": 0.25,
                                                      **tuning})


def test_an_iteration_that_tunes_runs_dptuner_on_its_tuning_step_before_dptrainer():
    import json

    from sage_tfx.pipelines.adaptive import build_iteration

    spec = _spec()
    built = build_iteration(spec, "tuned", "/nonexistent", "/nonexistent.sqlite", window=24,
                            epsilon=1.0, run_iteration=1, tuning_share=0.25)
    by_id = {component.id: component for component in built.components}
    grant, tuner, trainer = by_id["BlockLedger"], by_id["DPTuner"], by_id["DPTrainer"]
    assert json.loads(grant.exec_properties["split"])["tuning"] == "0.1125"  # 0.25 of 0.45
    assert json.loads(grant.exec_properties["step_mechanisms"])["tuning"]["mechanism"] == \
        "dp_tuning"
    assert trainer.inputs["hyperparameters"].producer_component_id == tuner.id
    assert tuner.exec_properties["l2_norm_clip"] == spec.trainer["l2_norm_clip"]
    # Without tuning, a released setting is carried as DPTrainer's parameters; no tuning step.
    carried = build_iteration(spec, "carried", "/nonexistent", "/nonexistent.sqlite", window=24,
                              epsilon=1.0, run_iteration=2,
                              setting={"learning_rate": 0.2, "l2_norm_clip": 1.0})
    by_id = {component.id: component for component in carried.components}
    assert "DPTuner" not in by_id and "tuning" not in json.loads(
        by_id["BlockLedger"].exec_properties["split"])
    assert by_id["DPTrainer"].exec_properties["learning_rate"] == 0.2


def test_a_bad_tuning_spec_is_refused_before_anything_is_charged():
    with pytest.raises(BadRequest, match="holdout_fraction must lie in"):
        _spec(holdout_fraction=1.5).check()


def test_a_tuning_share_too_small_for_the_search_is_refused_before_its_grant():
    """Papernot-Steinke's selection costs a fixed RDP overhead: at epsilon 1 with a quarter of
    the training share (0.1125, delta 1e-7 x 0.1125) no noise pays for it; the driver refuses
    before the BlockLedger runs."""
    from sage_tfx.pipelines.adaptive import iteration_split, preflight_iteration

    spec = _spec(score_fraction=0.3, trials_mean=2.0)
    with pytest.raises(BadRequest, match="DPTuner cannot tune at epsilon 1 .*nothing was charged"):
        preflight_iteration(spec, 1.0, iteration_split(spec, 0.25))
    preflight_iteration(spec, 8.0, iteration_split(spec, 0.5))


def test_a_tuning_metric_other_than_the_validators_is_refused_before_any_grant():
    """tune_next compares the tuner's released score with the validator's DP metric: a search
    scoring accuracy (DPTuner's default) under a loss validator would compare an accuracy with
    a loss. The spec's check (run before anything is charged) refuses it."""
    import dataclasses

    spec = _spec()
    assert spec.validation["metric"] == "loss"
    spec.check()
    tuning = {name: value for name, value in spec.tuning.items()
              if name not in ("metric", "loss_bound")}
    with pytest.raises(BadRequest, match="tuning's metric 'accuracy' differs from the "
                                         "validator's 'loss'"):
        dataclasses.replace(spec, tuning=tuning).check()
