"""The custom properties BlockExampleGen's executor writes on each block's Examples: the
executor writes them under these names and readers (benchmarks, people and UIs) read them by
these names."""

BLOCK_ID = "block_id"
BLOCK_START = "block_start"
BLOCK_END = "block_end"
