"""BlockExampleGen: new data as Sage blocks, registered in the BlockLedger."""
from sage_tfx.components.block_example_gen.component import BlockExampleGen, month_schedule

__all__ = ["BlockExampleGen", "month_schedule"]
