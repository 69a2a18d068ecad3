"""Closed forms the privacy tests check the code against (written here, not computed by it)."""
import math

from scipy import optimize, stats


def balle_wang_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """The analytic Gaussian mechanism's exact delta at epsilon (Balle & Wang 2018, Theorem 8):
    Phi(D / (2 s) - eps s / D) - e^eps Phi(-D / (2 s) - eps s / D)."""
    a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
    return stats.norm.cdf(a - b) - math.exp(epsilon) * stats.norm.cdf(-a - b)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at delta of a Gaussian mechanism with sensitivity / std = mu: the root
    of balle_wang_delta(1, mu, eps) = delta."""
    return optimize.brentq(lambda eps: balle_wang_delta(1.0, mu, eps) - delta, 0.0, 100.0)
