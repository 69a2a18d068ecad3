"""ObliviousSampleGen: data-oblivious minibatch sampling (Sasy and Ohrimenko, NeurIPS 2019)."""
from sage_tfx.components.oblivious_sample_gen.component import ObliviousSampleGen

__all__ = ["ObliviousSampleGen"]
