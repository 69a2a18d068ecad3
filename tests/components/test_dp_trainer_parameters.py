"""DPTrainer's preflight: the driver's pre-grant check is the trainer's own calibration, with the
trainer's defaults (epochs from the samples, its grant step); a bad mode names the allowed ones."""
import pytest

from sage_tfx.components.dp_trainer import TrainerMode, preflight
from sage_tfx.components.dp_trainer.calibrate import CalibrationError

SPLIT = {"transform": 0.1, "training": 0.1, "fit": 0.4, "validation": 0.4}
POISSON = {"scheme": "poisson", "gamma": 0.05, "epochs": 5}  # 20 steps per epoch


def test_preflight_uses_the_trainers_epochs_and_grant_step():
    # A share of epsilon 0.8 (grant 2, step "fit") pays one epoch at noise <= 2, not five.
    trainer = {"mode": "dp_sgd", "grant_step": "fit", "max_noise_multiplier": 2.0}
    preflight({**trainer, "epochs": 1}, POISSON, 2.0, 1e-6, SPLIT)
    # Without epochs the trainer trains on every epoch the samples hold.
    with pytest.raises(CalibrationError, match="cannot pay for 100 DP-SGD step"):
        preflight(trainer, POISSON, 2.0, 1e-6, SPLIT)
    # The default grant step is "training" (share 0.2): one epoch is already too much.
    with pytest.raises(CalibrationError, match="cannot pay for 20 DP-SGD step"):
        preflight({"max_noise_multiplier": 2.0, "epochs": 1}, POISSON, 2.0, 1e-6, SPLIT)
    # Steps under SWO depend on the data's size: nothing to decide before the grant.
    preflight(trainer, {"scheme": "swo", "sample_size": 64, "epochs": 5}, 2.0, 1e-6, SPLIT)


def test_a_bad_mode_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown trainer mode 'sgd'; use one of "
                                         r"\('dp_sgd', 'adassp'\)"):
        preflight({"mode": "sgd"}, POISSON, 2.0, 1e-6, SPLIT)
    # The enum keeps the string values TFX parameters and ML Metadata hold.
    assert TrainerMode.DP_SGD == "dp_sgd" and f"{TrainerMode.ADASSP}" == "adassp"
