"""The custom properties BlockExampleGen's executor writes on each block's Examples: the
executor writes them under these names and readers (benchmarks, people and UIs) read them by
these names."""

BLOCK_ID = "block_id"
BLOCK_START = "block_start"
BLOCK_END = "block_end"
# On the one Examples artifact of a run with per_block_artifacts=0: its blocks, a JSON list.
BLOCK_IDS = "block_ids"
