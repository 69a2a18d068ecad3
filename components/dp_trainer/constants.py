"""The custom properties DPTrainer's executor writes on the Model: the executor writes them under
these names and readers (the privacy-adaptive driver, people and UIs) read them by these names."""

GRANT_ID = "grant_id"
BLOCKS = "blocks"  # JSON list of the granted block ids the model was trained on
TRAINER_MODE = "trainer_mode"  # a parameters.TrainerMode value
# Exact decimal strings (ML Metadata's SQLite backend rounds doubles to 6 places).
DP_EPSILON = "dp_epsilon"
DP_DELTA = "dp_delta"
NOISE_MULTIPLIER = "noise_multiplier"
# DP-SGD only.
L2_NORM_CLIP = "l2_norm_clip"
LEARNING_RATE = "learning_rate"
STEPS = "steps"
EPOCHS = "epochs"
SAMPLING_SCHEME = "sampling_scheme"  # an oblivious_sample_gen Scheme value
# AdaSSP only.
FEATURE_BOUND = "feature_bound"
LABEL_BOUND = "label_bound"
LABEL_OFFSET = "label_offset"
