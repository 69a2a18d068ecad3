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
CONFIDENCE = "confidence"
EPSILON_USED = "epsilon_used"
