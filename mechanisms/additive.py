"""Additive noise: Laplace, Gaussian and their discrete versions, drawn by OpenDP.

Each function adds noise to every coordinate of ``values`` in one vectorised OpenDP call and
returns a :class:`Release` whose event covers the whole vector: the sensitivity arguments bound
the norm of the change of the WHOLE vector when one unit (record, user) is added or removed, so a
single LaplaceDpEvent / GaussianDpEvent describes the vector mechanism exactly (dp_accounting
defines both events for a vector with bounded L1 / L2 norm).

Float inputs are rounded to the lattice ``2**k`` before exact lattice noise is added (see the
package docstring). Rounding moves each coordinate by less than ``2**k``, which adds ``n * 2**k``
to the L1 sensitivity and ``sqrt(n) * 2**k`` to the L2 sensitivity; OpenDP's privacy map
includes it, the scale is calibrated on the rounded sensitivity, and the event is read back from
OpenDP's map, so it states the guarantee of what ran.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import dp_accounting
from dp_accounting import dp_event
import numpy as np
from dp_accounting import mechanism_calibration
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_mechanism
# OpenDP's own modules, not `opendp.prelude`: the prelude imports OpenDP's extras too
# (scikit-learn, Polars, ...), CPU that every process drawing noise paid at import, a Beam worker
# included (docs/measurements.md, issue 47). The functions are the same objects.
from opendp import domains, measurements, metrics
from opendp.mod import Measurement, enable_features

from sage_tfx.mechanisms.portable import floor_log2
from sage_tfx.mechanisms.release import Release

enable_features("contrib")

# The lattice sits 50 binary digits below the sensitivity, and OpenDP adds the rounding of every
# coordinate to it to the sensitivity: size 2**k in L1, sqrt(size) 2**k in L2. The noise scale
# takes that term for MAX_COORDINATES coordinates, not for the vector's own length: partition
# selection noises one count per partition the DATA holds, and a scale (or an event) that moved
# with that number would depend on one unit's records. It costs a relative 2**-14 of a Laplace
# scale, 2**-32 of a Gaussian's. Longer vectors are refused, but none can reach here: 2**36
# doubles are 512 GiB (a bound the data could cross would make the refusal itself a release).
_LATTICE_DIGITS_BELOW_SENSITIVITY = 50
MAX_COORDINATES = 2 ** 36


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def _delta(delta: float) -> float:
    delta = float(delta)
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    return delta


def _finite_floats(values, mechanism: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{mechanism}: values must be finite; map NaN/inf to a data-independent "
                         "default before bounding a record's contribution")
    return array


def _integers(values, mechanism: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iub":
        raise ValueError(f"{mechanism}: values must be integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def _lattice_exponent(sensitivity: float) -> int:
    return max(floor_log2(sensitivity) - _LATTICE_DIGITS_BELOW_SENSITIVITY, -1074)


# Building an OpenDP measurement and evaluating its privacy map cost ~0.3 ms of CPU, more than
# the noise for a short vector (a validator's two scalars), so measurements are built once per
# public parameter set and reused; every invocation still draws fresh noise from the OS CSPRNG.
@functools.lru_cache(maxsize=256)
def _measurement(noise: str, atom: str, size: Optional[int], scale: float, k: Optional[int],
                 sensitivity) -> tuple[Measurement, Optional[float]]:
    """OpenDP's ``noise`` ("laplace" / "gaussian") measurement on vectors of ``atom`` ("f64",
    sized, lattice 2**k; or "i64") and its privacy map at ``sensitivity``."""
    if atom == "f64":
        domain = domains.vector_domain(domains.atom_domain(T=float, nan=False), size=size)
    else:
        domain = domains.vector_domain(domains.atom_domain(T="i64"))
    if noise == "laplace":
        measurement = measurements.make_laplace(domain, metrics.l1_distance(T=atom), scale=scale,
                                                k=k)
    else:
        measurement = measurements.make_gaussian(domain, metrics.l2_distance(T=atom),
                                                 scale=scale, k=k)
    return measurement, None if sensitivity is None else measurement.map(sensitivity)


def _invoke(measurement, array: np.ndarray, dtype) -> np.ndarray:
    # OpenDP reads a contiguous numpy vector directly (no per-element Python conversion).
    flat = np.ascontiguousarray(array.ravel(), dtype=dtype)
    noisy = np.asarray(measurement(flat), dtype=dtype).reshape(array.shape)
    return noisy if array.ndim else noisy[()]


def _too_long(size: int) -> str:
    return (f"{size} values to noise in one release; at most {MAX_COORDINATES} "
            "(the noise scale is calibrated for that many)")


def _sized(array: np.ndarray) -> np.ndarray:
    if array.size > MAX_COORDINATES:
        raise ValueError(_too_long(array.size))
    return array


def _check_calibration(holds: bool, ran: float, asked: float) -> None:
    """Refuse to release when OpenDP's own privacy map says the measurement built is weaker than
    the one asked for (an explicit raise, not an assert: `python -O` must not remove it)."""
    if not holds:
        raise RuntimeError(f"the noise OpenDP built does not give the calibrated guarantee "
                           f"(ran {ran!r}, asked {asked!r}); nothing was released")


def laplace(values, *, l1_sensitivity: float, epsilon: float) -> Release:
    """``values`` + Laplace noise: epsilon-DP when one unit moves ``values`` by at most
    ``l1_sensitivity`` in L1 norm. Event: LaplaceDpEvent(scale / rounded sensitivity)."""
    l1_sensitivity = _positive("l1_sensitivity", l1_sensitivity)
    epsilon = _positive("epsilon", epsilon)
    array = _sized(_finite_floats(values, "laplace"))
    k = _lattice_exponent(l1_sensitivity)
    scale = (l1_sensitivity + MAX_COORDINATES * 2.0 ** k) / epsilon
    measurement, epsilon_run = _measurement("laplace", "f64", array.size, scale, k,
                                            l1_sensitivity)
    _check_calibration(epsilon_run <= epsilon * (1 + 1e-9), epsilon_run, epsilon)
    # the event is what was asked (epsilon_run, below it, depends on the vector's length)
    return Release(_invoke(measurement, array, np.float64),
                   dp_event.LaplaceDpEvent(noise_multiplier=1.0 / epsilon))


def discrete_laplace(values, *, l1_sensitivity: int, epsilon: float) -> Release:
    """Integer ``values`` + discrete Laplace (two-sided geometric) noise, P(z) ~ exp(-|z| eps /
    l1_sensitivity): epsilon-DP for integer changes of L1 norm at most ``l1_sensitivity``.
    Event: DiscreteLaplaceDpEvent(noise_parameter=eps / l1_sensitivity, l1_sensitivity)."""
    if int(l1_sensitivity) != l1_sensitivity or l1_sensitivity < 1:
        raise ValueError(f"l1_sensitivity must be a positive integer, got {l1_sensitivity!r}")
    l1_sensitivity = int(l1_sensitivity)
    epsilon = _positive("epsilon", epsilon)
    array = _integers(values, "discrete_laplace")
    scale = l1_sensitivity / epsilon
    measurement, epsilon_run = _measurement("laplace", "i64", None, scale, None,
                                            l1_sensitivity)
    _check_calibration(epsilon_run <= epsilon * (1 + 1e-9), epsilon_run, epsilon)
    return Release(_invoke(measurement, array, np.int64),
                   dp_event.DiscreteLaplaceDpEvent(
                       noise_parameter=epsilon_run / l1_sensitivity, sensitivity=l1_sensitivity))


# Calibrations are pure functions of public parameters and cost milliseconds (dp_accounting's
# binary searches): computed once per parameter set.
@functools.lru_cache(maxsize=256)
def gaussian_sigma(*, l2_sensitivity: float, epsilon: float, delta: float) -> float:
    """The smallest Gaussian standard deviation that is (epsilon, delta)-DP for L2 sensitivity
    ``l2_sensitivity``: the analytic Gaussian mechanism of Balle & Wang (2018), i.e. the sigma
    solving Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D) = delta, found by
    dp_accounting's exact Gaussian privacy loss (binary search, rounded up)."""
    parameters = pld_common.DifferentialPrivacyParameters(_positive("epsilon", epsilon),
                                                          _delta(delta))
    return privacy_loss_mechanism.GaussianPrivacyLoss.from_privacy_guarantee(
        parameters, sensitivity=_positive("l2_sensitivity", l2_sensitivity)).standard_deviation


def gaussian_lattice(*, l2_sensitivity: float, size: int,
                     noise_multiplier: float) -> tuple[float, int]:
    """``(sigma, k)`` of the Gaussian that :func:`gaussian_with_noise_multiplier` runs on
    ``size`` coordinates: the standard deviation noise_multiplier * (l2_sensitivity +
    sqrt(MAX_COORDINATES) * 2**k), the same for every size up to MAX_COORDINATES, and the
    lattice exponent k (every noisy value is a multiple of 2**k before the final rounding to a
    double). Partition selection needs both to bound the noise's tail."""
    if size > MAX_COORDINATES:
        raise ValueError(_too_long(size))
    k = _lattice_exponent(l2_sensitivity)
    return noise_multiplier * (l2_sensitivity + math.sqrt(MAX_COORDINATES) * 2.0 ** k), k


def gaussian_with_noise_multiplier(values, *, l2_sensitivity: float,
                                   noise_multiplier: float) -> Release:
    """``values`` + N(0, s^2) per coordinate with s = noise_multiplier * (L2 sensitivity rounded
    up for the lattice), for a caller that calibrated the multiplier itself (AdaSSP composes
    three releases). Event: GaussianDpEvent(noise_multiplier), exactly what the caller asked."""
    l2_sensitivity = _positive("l2_sensitivity", l2_sensitivity)
    noise_multiplier = _positive("noise_multiplier", noise_multiplier)
    array = _finite_floats(values, "gaussian")
    sigma, k = gaussian_lattice(l2_sensitivity=l2_sensitivity, size=array.size,
                                noise_multiplier=noise_multiplier)
    # OpenDP's map: rho = (rounded sensitivity / sigma)^2 / 2
    measurement, rho = _measurement("gaussian", "f64", array.size, sigma, k, l2_sensitivity)
    multiplier_run = 1.0 / math.sqrt(2.0 * rho)
    _check_calibration(multiplier_run >= noise_multiplier * (1 - 1e-9), multiplier_run,
                       noise_multiplier)
    return Release(_invoke(measurement, array, np.float64),
                   dp_event.GaussianDpEvent(noise_multiplier=noise_multiplier))


def gaussian(values, *, l2_sensitivity: float, epsilon: float, delta: float) -> Release:
    """``values`` + analytic-Gaussian noise: (epsilon, delta)-DP for L2 sensitivity
    ``l2_sensitivity``, the multiplier from :func:`gaussian_sigma` at sensitivity 1."""
    return gaussian_with_noise_multiplier(
        values, l2_sensitivity=l2_sensitivity,
        noise_multiplier=gaussian_sigma(l2_sensitivity=1.0, epsilon=epsilon, delta=delta))


def laplace_count_and_sum(counts, sums, *, value_bound: float, epsilon: float) -> Release:
    """The DP (count, sum) pair per public key, the release the SLAed validator and the DP mean
    analyzers share. Each record adds 1 to one key's count and a value v with |v| <=
    ``value_bound`` to the same key's sum; adding or removing it changes the count vector by 1
    and the sum vector by <= value_bound in L1 norm, whatever the number of keys (parallel
    composition across keys). Laplace at epsilon/2 on each: value (dp_counts, dp_sums), event
    ComposedDpEvent([count's LaplaceDpEvent, sum's LaplaceDpEvent]), epsilon in total."""
    epsilon = _positive("epsilon", epsilon)
    count = laplace(counts, l1_sensitivity=1.0, epsilon=epsilon / 2.0)
    total = laplace(sums, l1_sensitivity=_positive("value_bound", value_bound),
                    epsilon=epsilon / 2.0)
    return Release((count.value, total.value),
                   dp_event.ComposedDpEvent([count.event, total.event]))


def discrete_gaussian(values, *, l2_sensitivity: float, epsilon: float, delta: float) -> Release:
    """Integer ``values`` + discrete Gaussian noise N_Z(0, sigma^2) (Canonne, Kamath & Steinke
    2020, exact sampler). CKS Theorem 4: it is rho-zCDP with rho = D^2 / (2 sigma^2) for integer
    vectors whose change has L2 norm at most D, like the continuous Gaussian. Event:
    ZCDpEvent(rho), which the RDP accountant composes; sigma is the smallest for which that
    event is (epsilon, delta)-DP by dp_accounting's RDP conversion (calibrate_dp_mechanism)."""
    l2_sensitivity = _positive("l2_sensitivity", l2_sensitivity)
    array = _integers(values, "discrete_gaussian")
    sigma = _discrete_gaussian_sigma(l2_sensitivity, _positive("epsilon", epsilon),
                                     _delta(delta))
    # OpenDP's map takes an integer sensitivity; zCDP's rho grows as its square, so its rho at
    # sensitivity 1 times D^2 is what ran, and the event must not report less.
    measurement, rho_per_unit = _measurement("gaussian", "i64", None, sigma, None, 1)
    event = _zcdp_event(l2_sensitivity, sigma)
    _check_calibration(event.rho >= l2_sensitivity ** 2 * rho_per_unit * (1 - 1e-9),
                       l2_sensitivity ** 2 * rho_per_unit, event.rho)
    return Release(_invoke(measurement, array, np.int64), event)


def _zcdp_event(l2_sensitivity: float, sigma: float) -> dp_event.ZCDpEvent:
    return dp_event.ZCDpEvent(rho=l2_sensitivity ** 2 / (2.0 * sigma ** 2))


@functools.lru_cache(maxsize=256)
def _discrete_gaussian_sigma(l2_sensitivity: float, epsilon: float, delta: float) -> float:
    analytic_sigma = gaussian_sigma(l2_sensitivity=l2_sensitivity, epsilon=epsilon, delta=delta)
    return mechanism_calibration.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant, functools.partial(_zcdp_event, l2_sensitivity),
        epsilon, delta,
        # No mechanism beats the analytic Gaussian's sigma: it is a valid lower end.
        mechanism_calibration.LowerEndpointAndGuess(analytic_sigma, 2.0 * analytic_sigma),
        tol=1e-6 * l2_sensitivity / epsilon)
