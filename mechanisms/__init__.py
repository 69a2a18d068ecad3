"""The only code in sage-tfx that draws privacy noise (docs/architecture.md), with one
exception: DP-SGD's Gaussians, a million or more per second of training, are drawn in float32
from an AES keystream under keys from sage_tfx.randomness.secret_key (OpenDP's sampler takes
about a minute per million draws); components/dp_trainer/dp_sgd.py says what its epsilon does
and does not prove.

Why a vetted sampler, and why OpenDP
------------------------------------
Mironov (2012, "On significance of the least significant bits for differential privacy") showed
that textbook floating-point Laplace noise, ``x + b * log(U)`` with a 53-bit uniform ``U`` (which
is what ``numpy.random.Generator.laplace`` does), is not differentially private: the set of
doubles the noisy output can take depends on ``x``, so the low-order bits of one release can
reveal ``x`` exactly. The same porous-output problem holds for Box-Muller/ziggurat Gaussians.
The fix is to sample noise exactly on a grid and round only at the end (snapping, or exact
discrete samplers on a lattice; Canonne, Kamath & Steinke 2020 for the discrete Gaussian).

We draw from OpenDP (pinned in requirements, 0.16.0) rather than Google's python-dp because:
* OpenDP's samplers are exact: a float input is rounded to the lattice ``2**k``, exact discrete
  Laplace / discrete Gaussian noise is added on the lattice with arbitrary-precision arithmetic,
  and the result is rounded to a double once (post-processing). Its privacy maps account for the
  rounding (``n * 2**k`` more L1 sensitivity, ``sqrt(n) * 2**k`` more L2), and we read the
  guarantee back from those maps, so the DpEvent describes what ran, rounding included.
* It is vectorised in Rust: one call adds noise to a whole vector. python-dp adds noise to one
  scalar per Python call, and has no discrete Gaussian.
* Its randomness comes from the OS CSPRNG (no seed can be passed): the architecture's
  cryptographically seeded default is the only mode, so there is no unsafe path to misuse.

Randomness and tests
--------------------
The product path never takes a seed. Tests of these mechanisms are statistical: they compare the
empirical law with the closed form using bounds whose false-failure rate is written in the test,
and each is shown to fail on a deliberately broken variant (half the noise, wrong scale).
Sampling (not noise) still uses ``sage_tfx.randomness.secret_rng``, whose fixed seed is for tests.

What each mechanism returns
---------------------------
A frozen :class:`Release` ``(value, event, additional_delta)``: ``event`` is the dp_accounting
DpEvent that describes exactly the noise that ran (sensitivity incl. lattice rounding, scale);
``additional_delta`` is the delta a partition-selection step spends outside any DpEvent
dp_accounting can express (0 for the additive mechanisms; see ``selection`` for partition
selection: Laplace and Gaussian thresholding, truncated-geometric selection, weighted Gaussian).
"""
from sage_tfx.mechanisms.bounding import bounded
from sage_tfx.mechanisms.release import Release
from sage_tfx.mechanisms.additive import (discrete_gaussian, discrete_laplace, gaussian,
                                          gaussian_sigma, gaussian_with_noise_multiplier, laplace,
                                          laplace_count_and_sum)
from sage_tfx.mechanisms.selection import (Selection, gaussian_threshold, laplace_threshold,
                                           truncated_geometric_keep_probability,
                                           truncated_geometric_selection, unit_weight,
                                           weighted_gaussian_selection)

__all__ = ["bounded", "Release", "laplace", "discrete_laplace", "gaussian", "gaussian_sigma",
           "gaussian_with_noise_multiplier", "discrete_gaussian", "laplace_count_and_sum",
           "Selection", "laplace_threshold", "gaussian_threshold",
           "truncated_geometric_keep_probability", "truncated_geometric_selection",
           "unit_weight", "weighted_gaussian_selection"]
