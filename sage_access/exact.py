"""Exact decimals in ML Metadata: the one place the platform works around MLMD's doubles.

ML Metadata 1.17's SQLite backend keeps only 6 decimal places of a `double_value` (1e-7 reads
back as 0), so every budget, bound or parameter a record must keep exactly is stored as the
decimal string that round-trips the double (`repr`), and split fractions are read as the
decimals they were written as (0.1 is 1/10, not the nearest double).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Optional

from sage_tfx.sage_access.errors import BadRequest


def exact_decimal(value) -> str:
    """The decimal string that reads back as exactly the double `float(value)`."""
    return repr(float(value))


def exact_fraction(value) -> Fraction:
    """A decimal fraction exactly as written (0.1 is 1/10, not the nearest double)."""
    if isinstance(value, Fraction):
        return value
    text = exact_decimal(value) if isinstance(value, float) else str(value)
    try:
        fraction = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise BadRequest(f"not a finite number: {value!r}") from None
    return fraction


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
