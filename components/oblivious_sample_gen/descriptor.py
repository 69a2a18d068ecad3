"""What sampling ran: the descriptor that travels with the samples to the trainer.

It describes the layout the trainer reads (epochs one after another, each `slots_per_epoch`
slots long, in units of `slot_width` slots, one unit per step) and everything the accountant
needs. Every field is a function of public parameters and of `n`, the size the data was brought
to: a public bound or a DP count (accounting.py). No exact count of private data is in it. It is stored as custom properties of the
samples' Examples artifact (floats as exact decimal strings: sage_access/exact.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Optional

from sage_tfx.choices import Choice
from sage_tfx.components.oblivious_sample_gen.constants import DESCRIPTOR_PREFIX
from sage_tfx.sage_access.exact import exact_decimal


class Scheme(Choice):
    """How ObliviousSampleGen samples (sampling.py): without replacement, Poisson, or one
    shuffle split into batches per epoch."""
    SWO = "swo"
    POISSON = "poisson"
    SHUFFLE = "shuffle"


@dataclass(frozen=True)
class SamplingDescriptor:
    scheme: Scheme
    n: int  # rows sampled from: the data padded or cut to a public bound or a DP count
    epochs: int
    # Steps the trainer runs per epoch: one per sample. For Poisson it is the fixed
    # floor(1 / gamma); samples that did not fit (probability <= truncation_probability)
    # are run as empty, noise-only steps so the number of steps never depends on the data.
    samples_per_epoch: int
    slots_per_epoch: int  # layout length of one epoch, dummies included
    sample_size: Optional[int] = None  # m, for swo and shuffle
    gamma: Optional[float] = None  # for poisson
    truncation_probability: float = 0.0  # per epoch, Poisson only
    # Once per run, Poisson only: the probability that the DP count fell so far below the
    # true count that records were cut (accounting.py).
    size_truncation_probability: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "scheme", Scheme.parse(self.scheme, "sampling scheme"))
        if (self.gamma is None) != (self.scheme != Scheme.POISSON):
            raise ValueError("gamma is given exactly for the poisson scheme")
        if (self.sample_size is None) != (self.scheme == Scheme.POISSON):
            raise ValueError("sample_size is given exactly for the swo and shuffle schemes")

    @property
    def slot_width(self) -> int:
        """Slots per sample unit: m for SWO/shuffling, the padded width for Poisson."""
        return self.slots_per_epoch // self.samples_per_epoch

    @property
    def steps(self) -> int:
        return self.samples_per_epoch * self.epochs

    @property
    def expected_batch_size(self) -> float:
        """What the trainer divides a noisy gradient sum by (for Poisson the expected size, as
        the actual size is private; paper §5)."""
        return self.gamma * self.n if self.scheme == Scheme.POISSON else float(self.sample_size)

    def to_properties(self) -> dict[str, str | int]:
        return {DESCRIPTOR_PREFIX + key: (exact_decimal(value) if isinstance(value, float) else
                                    "" if value is None else value)
                for key, value in asdict(self).items()}

    @classmethod
    def from_properties(cls, properties: Mapping[str, object]) -> "SamplingDescriptor":
        def value(key: str):
            raw = properties.get(DESCRIPTOR_PREFIX + key)
            if raw is None:
                raise ValueError(f"the samples carry no sampling descriptor field {key!r}")
            return raw
        gamma, size = value("gamma"), value("sample_size")
        return cls(scheme=str(value("scheme")), n=int(value("n")), epochs=int(value("epochs")),
                   samples_per_epoch=int(value("samples_per_epoch")),
                   slots_per_epoch=int(value("slots_per_epoch")),
                   sample_size=None if size in ("", None) else int(size),
                   gamma=None if gamma in ("", None) else float(gamma),
                   truncation_probability=float(value("truncation_probability")),
                   size_truncation_probability=float(value("size_truncation_probability")))
