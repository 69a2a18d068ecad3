"""The matrix mechanism: noisy strategy answers, then least-squares answers to the workload.

    y = A x + noise          (sage_tfx.mechanisms: the only code that draws noise)
    x_hat = A^+ y            (least squares; post-processing)
    answers = W x_hat        (consistent: every answer is W times the one vector x_hat)

Privacy. ``x`` is a histogram over the declared domain in which each record counts once, so
adding or removing one record moves x by +-e_j for one cell j and A x by the column A e_j:
L2 sensitivity max_j ||A e_j||_2 (Gaussian) and L1 sensitivity max_j ||A e_j||_1 (Laplace),
which is what :class:`Strategy` computes and what the noise module is given. The noise module
returns the dp_accounting event of what ran (GaussianDpEvent / LaplaceDpEvent, lattice rounding
included); everything after the noise is post-processing, so the release's guarantee is that
event's. The strategy depends on the workload only (never on x), so choosing it costs nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from dp_accounting import dp_event

from sage_tfx import mechanisms
from sage_tfx.choices import Choice
from sage_tfx.dp_statistics.matrix import error
from sage_tfx.dp_statistics.matrix.strategy import as_strategy, as_workload
from sage_tfx.dp_statistics.matrix.workload import DomainError


class Noise(Choice):
    GAUSSIAN = "gaussian"
    LAPLACE = "laplace"


@dataclasses.dataclass(frozen=True)
class WorkloadRelease:
    """``answers`` = W ``estimate`` (None for a union strategy: each group of queries has its
    own least-squares estimate, union.py); ``query_rmse`` each answer's expected error (data
    independent); ``event`` the dp_accounting event of the noise that ran; ``strategy`` the
    name of the strategy (its family) the noise was added to."""
    answers: np.ndarray
    estimate: Optional[np.ndarray]
    query_rmse: np.ndarray
    expected_rmse: float
    event: dp_event.DpEvent
    noise: Noise
    epsilon: float
    delta: float
    strategy: str


def histogram_vector(data_vector, cells: int) -> np.ndarray:
    """The data vector checked: ``cells`` non-negative integer counts (one per record)."""
    vector = np.asarray(data_vector)
    if vector.shape != (cells,):
        raise DomainError(f"the data vector has shape {vector.shape}; the declared domain has "
                          f"{cells} cells")
    if vector.dtype.kind not in "iub" or np.any(vector < 0):
        raise ValueError("the data vector must hold non-negative integer counts (each record "
                         "counted once): that is what the sensitivity assumes")
    return vector.astype(np.float64)


def answer_workload(workload, strategy, data_vector, *, epsilon: float,
                    delta: Optional[float] = None,
                    noise: Noise = Noise.GAUSSIAN) -> WorkloadRelease:
    """Answer every query of ``workload`` from ``strategy``'s noisy answers (module docstring).
    Refuses, before any noise is drawn, a strategy that does not support the workload and a
    data vector outside the declared domain."""
    workload, strategy = as_workload(workload), as_strategy(strategy)
    noise = Noise.parse(noise, "noise")
    strategy.require_support(workload)
    vector = histogram_vector(data_vector, workload.cells)
    exact = strategy.apply(vector)
    if noise is Noise.GAUSSIAN:
        if delta is None:
            raise ValueError("the Gaussian matrix mechanism needs delta")
        scale = mechanisms.gaussian_sigma(l2_sensitivity=strategy.l2_sensitivity,
                                          epsilon=epsilon, delta=delta)
        release = mechanisms.gaussian(exact, l2_sensitivity=strategy.l2_sensitivity,
                                      epsilon=epsilon, delta=delta)
    else:  # Noise.LAPLACE
        delta = 0.0
        scale = np.sqrt(2.0) * strategy.l1_sensitivity / epsilon
        release = mechanisms.laplace(exact, l1_sensitivity=strategy.l1_sensitivity,
                                     epsilon=epsilon)
    answers, estimate = strategy.answer(workload, release.value)
    query_rmse = error.query_rmse(workload, strategy, scale)
    return WorkloadRelease(
        answers=answers, estimate=estimate, query_rmse=query_rmse,
        expected_rmse=float(np.sqrt(np.mean(query_rmse ** 2))), event=release.event,
        noise=noise, epsilon=float(epsilon), delta=float(delta), strategy=strategy.name)
