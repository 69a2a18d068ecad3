"""Helpers shared by the tests (not tests themselves). setup.cfg puts tests/ on pytest's
pythonpath, so a test in any folder imports them as `support.<module>`."""
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
# The clone: docs/, the Dockerfile, setup.cfg, benchmarks/ and examples/ are read from here.
REPO_ROOT = os.path.dirname(os.path.dirname(_HERE))

# Files the code under test loads by path: a DPTrainer module file and worker processes.
TRIP_MODULE = os.path.join(_HERE, "trip_module.py")
TUNER_MODULE = os.path.join(_HERE, "tuner_module.py")  # DPTuner's easy seeded problem
# TFX's taxi template, its Transform and Trainer halves (DPTransform's, DPTrainer's modules).
TFX_TRANSFORM_MODULE = os.path.join(_HERE, "tfx_taxi_transform.py")
TFX_TRAINER_MODULE = os.path.join(_HERE, "tfx_taxi_trainer.py")
LEDGER_WORKER = os.path.join(_HERE, "ledger_worker.py")
STREAM_WORKER = os.path.join(_HERE, "stream_worker.py")  # the DP-SQLP durability test
