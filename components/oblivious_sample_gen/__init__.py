"""ObliviousSampleGen: data-oblivious minibatch sampling (Sasy and Ohrimenko, NeurIPS 2019).

`ObliviousSampleGen` is imported lazily (PEP 562), so the sampling and accounting modules load
without TFX or TensorFlow (DPTrainer's calibrate command uses them).
"""
__all__ = ["ObliviousSampleGen"]


def __getattr__(name: str):
    if name == "ObliviousSampleGen":
        from sage_tfx.components.oblivious_sample_gen.component import ObliviousSampleGen
        return ObliviousSampleGen
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
