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
