"""BlockExampleGen: new data as Sage blocks, registered in the BlockLedger."""
from sage_tfx.components.block_example_gen.component import BlockExampleGen

__all__ = ["BlockExampleGen"]
