"""DP-SQLP §5.1's synthetic stream, scaled to this machine (issue 19 §3).

The paper: 10^7 users; each draws its number of records from a Zipf-Mandelbrot law on
[1, 10^5], P(x) ~ (x + q)^-s with q = 26, s = 6.738 (footnote 9), "mean 10" with "roughly 15% of
users contributing more than 10 records"; each record's key from a Zipf-Mandelbrot law over 10^6
keys with q = 1000, s = 1.4 (footnote 10: "roughly 1/3 of records have the first 10^3 keys");
records shuffled uniformly over one day, the event-time window.

The footnote does not give mean 10. Exactly (summing the pmf over [1, 10^5]): mean 6.115,
P(x > 10) = 15.9%, 99th percentile 33 (the paper's C = 32 is "the 99th percentile of records
per user", which matches). So the 15% and C = 32 fit the footnote, the mean does not. We keep
q = 26 and solve the exponent s for the mean asked (``records_exponent``): mean 10 gives
s = 4.794, P(x > 10) = 29.7%, 99th percentile 63 (C = 32 then clips more); asking for the
footnote's mean (6.115) gives back s = 6.738. :func:`records_law` reports all three figures.
Keys: at 10^5 keys (our default) the first 10^3 hold 28.7% of the records (25.8% at the
paper's 10^6 keys: the footnote's "roughly 1/3").

Everything is vectorised numpy (inverse-CDF sampling by ``searchsorted``); 10^7 records take a
few seconds. The data are a benchmark's, so they are seeded (``seed``) for repeatability.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy import optimize

WINDOW_SECONDS = 86_400.0  # one day, the paper's event-time window
MAX_RECORDS_PER_USER = 10 ** 5
RECORDS_SHIFT, FOOTNOTE_RECORDS_EXPONENT = 26.0, 6.738
KEYS_SHIFT, KEYS_EXPONENT = 1000.0, 1.4


def zipf_mandelbrot_pmf(size: int, shift: float, exponent: float) -> np.ndarray:
    """P(x) ~ (x + shift)^-exponent on x = 1..size (index x - 1)."""
    weights = (np.arange(1, size + 1, dtype=np.float64) + shift) ** -exponent
    return weights / weights.sum()


def records_exponent(mean: float) -> float:
    """The exponent s for which records per user (q = 26 on [1, 10^5]) has this mean."""
    support = np.arange(1, MAX_RECORDS_PER_USER + 1, dtype=np.float64)

    def excess(exponent: float) -> float:
        return float(zipf_mandelbrot_pmf(MAX_RECORDS_PER_USER, RECORDS_SHIFT, exponent)
                     @ support) - mean

    if not 1.0 < mean < MAX_RECORDS_PER_USER / 2:
        raise ValueError(f"mean records per user must lie in (1, {MAX_RECORDS_PER_USER // 2}), "
                         f"got {mean!r}")
    # the mean falls from ~(10^5 / 2) towards 1 as s grows from 1 to 40
    return float(optimize.brentq(excess, 1.0 + 1e-9, 40.0, xtol=1e-12))


@dataclasses.dataclass(frozen=True)
class RecordsLaw:
    exponent: float
    mean: float
    above_ten: float      # P(x > 10)
    percentile_99: int


def records_law(exponent: float) -> RecordsLaw:
    pmf = zipf_mandelbrot_pmf(MAX_RECORDS_PER_USER, RECORDS_SHIFT, exponent)
    support = np.arange(1, MAX_RECORDS_PER_USER + 1)
    return RecordsLaw(exponent, float(pmf @ support), float(pmf[10:].sum()),
                      int(support[np.searchsorted(np.cumsum(pmf), 0.99)]))


def _sample(pmf: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Indices 0..len(pmf)-1 drawn from ``pmf`` by inverse CDF."""
    cdf = np.cumsum(pmf)
    cdf[-1] = 1.0
    return np.searchsorted(cdf, rng.random(size), side="right")


@dataclasses.dataclass(frozen=True)
class Stream:
    """Records in arrival order (event time ascending). ``user`` in [0, users), ``key`` in
    [0, keys) (key 0 the most popular), ``time`` in [0, WINDOW_SECONDS)."""
    user: np.ndarray
    key: np.ndarray
    time: np.ndarray
    users: int
    keys: int
    records_law: RecordsLaw

    def __len__(self) -> int:
        return self.user.size

    def true_histogram(self) -> np.ndarray:
        """COUNT(*) per key over the whole stream, before any contribution bound."""
        return np.bincount(self.key, minlength=self.keys).astype(np.float64)

    def micro_batch(self, micro_batches: int) -> np.ndarray:
        """Each record's micro-batch 0..T-1: [i w, (i + 1) w), w = window / T (a public
        function of the window, never of the data)."""
        width = WINDOW_SECONDS / micro_batches
        return np.minimum((self.time // width).astype(np.int64), micro_batches - 1)


def generate(users: int, keys: int, mean_records_per_user: float, seed: int) -> Stream:
    for name, value in (("users", users), ("keys", keys)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    rng = np.random.default_rng(seed)
    law = records_law(records_exponent(mean_records_per_user))
    per_user = 1 + _sample(zipf_mandelbrot_pmf(MAX_RECORDS_PER_USER, RECORDS_SHIFT,
                                               law.exponent), users, rng)
    user = np.repeat(np.arange(users, dtype=np.int64), per_user)
    key = _sample(zipf_mandelbrot_pmf(keys, KEYS_SHIFT, KEYS_EXPONENT), user.size, rng)
    time = rng.random(user.size) * WINDOW_SECONDS
    order = np.argsort(time, kind="stable")
    return Stream(user[order], key[order].astype(np.int64), time[order], users, keys, law)

