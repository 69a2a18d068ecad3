"""The custom properties of SLAedValidator's ModelBlessing: the executor writes them under these
names and the privacy-adaptive driver reads them by these names. BLESSED, CURRENT_MODEL and
CURRENT_MODEL_ID are TFX's own blessing keys (TFX's Pusher reads BLESSED)."""

BLESSED = "blessed"
CURRENT_MODEL = "current_model"
CURRENT_MODEL_ID = "current_model_id"
OUTCOME = "outcome"  # a slaed.Outcome value
METRIC = "metric"  # a slaed.Metric value
# Exact decimal strings (ML Metadata's SQLite backend rounds doubles to 6 places).
DP_METRIC = "dp_metric"
LOWER_BOUND = "lower_bound"
UPPER_BOUND = "upper_bound"
TARGET = "target"
CONFIDENCE = "confidence"  # the level of lower_bound and upper_bound (this test's)
# In a privacy-adaptive run (pipelines/adaptive.py): the run's confidence, this test's iteration
# (its confidence is slaed.iteration_confidence of both) and the run-level guarantee in words.
RUN_CONFIDENCE = "run_confidence"
RUN_ITERATION = "run_iteration"
GUARANTEE = "guarantee"
EPSILON_USED = "epsilon_used"
# The baseline test (slaed.baseline_gap_validator): the DP gap between the best baseline's loss
# and the model's, its lower bound, the margin asked for, and how many baselines took part.
BASELINE_GAP = "baseline_gap"
BASELINE_GAP_LOWER_BOUND = "baseline_gap_lower_bound"
BASELINE_MARGIN = "baseline_margin"
BASELINES = "baselines"
