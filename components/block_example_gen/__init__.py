"""BlockExampleGen: new data as Sage blocks, registered in the BlockLedger.

Imported lazily (PEP 562, as sage_tfx.components): a process that only reads CSV rows
(csv_rows) loads TensorFlow without TFX or Beam.
"""
__all__ = ["BlockExampleGen", "month_schedule"]


def __getattr__(name: str):
    if name in __all__:
        from sage_tfx.components.block_example_gen import component
        return getattr(component, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
