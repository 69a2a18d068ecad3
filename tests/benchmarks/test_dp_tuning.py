"""benchmarks/dp_tuning.py's pieces for the TFX template's task: DPTrainer's DP-SGD on Poisson
samples (the template pipeline's sampling) and the held-out classifier metrics."""
import importlib.util
import os
import sys

import numpy as np
import tensorflow as tf

from support import REPO_ROOT, TUNER_MODULE

from sage_tfx.components.util.user_module import UserModule

# The benchmark is a script beside the others (not a package): loaded by path.
_loaded = importlib.util.spec_from_file_location(
    "dp_tuning", os.path.join(REPO_ROOT, "benchmarks", "dp_tuning.py"))
dp_tuning = sys.modules["dp_tuning"] = importlib.util.module_from_spec(_loaded)
_loaded.loader.exec_module(dp_tuning)


def _problem(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 2)).astype(np.float32)
    return x, (x.sum(axis=1) > 0).astype(np.float32)


def test_poisson_dp_sgd_learns_and_the_held_out_metrics_read_it():
    """2 epochs of 10 Poisson samples (gamma 0.1) of 1,000 records at epsilon 8: the logistic
    model learns the boundary x1 + x2 = 0 (seed 0: held-out AUC ~0.99, accuracy ~0.95), while
    the untrained zero model's AUC is 0.5 (every score equal). A linear classifier whose weights
    lie at angle t from (1, 1) has accuracy 1 - t / pi on this symmetric Gaussian: failing
    accuracy > 0.8 needs the noise to turn the weights by more than 36 degrees."""
    module = UserModule.load(TUNER_MODULE, "benchmark", ("build_model",))
    x, y = _problem(1000, 0)
    held_x, held_y = _problem(2000, 1)
    model = dp_tuning.train(module, x, y.reshape(-1, 1), {"learning_rate": 2.0,
                                                          "l2_norm_clip": 1.0},
                            8.0, 1e-6, 2, seed=0, gamma=0.1)
    metrics = dp_tuning.classifier_metrics(model, tf.constant(held_x), held_y)
    assert metrics["auc"] > 0.9 and metrics["accuracy"] > 0.8
    untrained = dp_tuning.classifier_metrics(module.build_model(), tf.constant(held_x), held_y)
    assert untrained["auc"] == 0.5
