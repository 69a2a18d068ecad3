"""Loaded at start-up by each task process of a test's Kubeflow job (this directory and tests/
are put on its PYTHONPATH): every sage_tfx.mechanisms release draws from numpy seeded with 0,
with the law, scale and accounting of the OpenDP measurement it replaces (conftest.py's
seeded_noise, for tasks in their own processes), so the job's outcome repeats. Tests only."""
from sage_tfx.mechanisms import additive

from support.seeded_noise import seeded_measurement

additive._measurement = seeded_measurement()
