"""Exact decimals in ML Metadata: the one place the platform works around MLMD's doubles.

ML Metadata 1.17's SQLite backend keeps only 6 decimal places of a `double_value` (1e-7 reads
back as 0), so every budget, bound or parameter a record must keep exactly is stored as the
decimal string that round-trips the double (`repr`), and split fractions are read as the
decimals they were written as (0.1 is 1/10, not the nearest double).

Budgets are exact too: the ledger reads every epsilon and delta as the decimal it is written as
and sums, compares and stores the budget vectors of its blocks as fractions (`exact_vector`,
`exact_text`), so 20 grants of 0.05 spend exactly a ceiling of 1, and what a denial calls
available (`float_at_most`) can be requested.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Iterable, Optional

import numpy as np

from sage_tfx.sage_access.errors import BadRequest

# Beyond this many decimal places a stored fraction is written as "p/q" (a reservation of 1/3,
# a sum of curve values spanning many magnitudes): shorter, and just as exact.
_MAX_DECIMAL_PLACES = 40


def exact_decimal(value) -> str:
    """The decimal string that reads back as exactly the double `float(value)`."""
    return repr(float(value))


def exact_fraction(value) -> Fraction:
    """A decimal fraction exactly as written (0.1 is 1/10, not the nearest double)."""
    if isinstance(value, Fraction):
        return value
    text = exact_decimal(value) if isinstance(value, float) else str(value)
    try:
        return _parsed(text)
    except (ValueError, ZeroDivisionError):
        raise BadRequest(f"not a finite number: {value!r}") from None


# A grant decodes and re-encodes every budget of the blocks it charges, mostly the same few
# texts ("0.0", a ceiling, a request): parsing each once saves most of a grant's Python time.
# Fractions are immutable, so sharing them is safe.
@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Fraction:
    return Fraction(text)


def exact_vector(values: Iterable) -> np.ndarray:
    """A budget vector of exact fractions (numpy object array): each value read by
    `exact_fraction` (a double as the decimal it is written as, a stored text as written). Sums,
    differences, divisions by counts and comparisons of such vectors stay exact; mixing in a
    float would not, so the ledger's arithmetic uses only these and ints."""
    return np.array([exact_fraction(value) for value in values] or [], dtype=object)


def exact_text(value) -> str:
    """The text that `exact_fraction` reads back as exactly `value`: a plain decimal ("0.95",
    "1e-06" for a double's own decimal) when it terminates within 40 places, else "p/q"."""
    return _text(exact_fraction(value))


@functools.lru_cache(maxsize=4096)  # as _parsed: the same few budgets, over and over
def _text(value: Fraction) -> str:
    as_double = float(value)
    if math.isfinite(as_double) and exact_fraction(as_double) == value:
        return exact_decimal(as_double)
    # A decimal terminates iff the denominator is 2^a 5^b; it then needs max(a, b) places.
    denominator, places = value.denominator, 0
    for prime in (2, 5):
        count = 0
        while denominator % prime == 0:
            denominator //= prime
            count += 1
        places = max(places, count)
    if denominator != 1 or places > _MAX_DECIMAL_PLACES:
        return f"{value.numerator}/{value.denominator}"
    sign = "-" if value < 0 else ""
    digits = str(abs(value.numerator) * 10 ** places // value.denominator).rjust(places + 1, "0")
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def float_at_most(value) -> float:
    """The largest double whose decimal (as written, `exact_fraction`) is at most `value`: what
    a message may call available, so that asking for exactly that can be granted."""
    value = exact_fraction(value)
    result = float(value)
    while exact_fraction(result) > value:
        result = math.nextafter(result, -math.inf)
    return result


def set_exact_property(artifact, name: str, value) -> None:
    """Set a TFX artifact's custom property `name` to the exact decimal of `value`."""
    artifact.set_string_custom_property(name, exact_decimal(value))


def custom_value(artifact, name: str):
    """A custom property's value as written (str, int or float; None when there is none), read
    from a TFX artifact or an MLMD record. On Kubeflow an artifact passed from one task to the
    next arrives as JSON metadata, which TFX's entrypoint stores as struct values (a number then
    reads back as a float); plain values are read as MLMD holds them."""
    properties = getattr(artifact, "mlmd_artifact", artifact).custom_properties
    if name not in properties:
        return None
    value = properties[name]
    if value.HasField("struct_value"):  # only TFX artifacts are built from Kubeflow's JSON
        return artifact.get_json_value_custom_property(name)
    return getattr(value, value.WhichOneof("value"))


def exact_property(artifact, name: str) -> Optional[float]:
    """The float stored with `set_exact_property` (None when there is none), read from a TFX
    artifact or an MLMD record."""
    value = custom_value(artifact, name)
    return None if value is None else float(value)
