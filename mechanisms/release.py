"""The value of a DP mechanism together with the dp_accounting event that describes what ran."""
from __future__ import annotations

import dataclasses
from typing import Any

import dp_accounting
from dp_accounting import dp_event


@dataclasses.dataclass(frozen=True)
class Release:
    """A noisy ``value`` and the ``event`` an accountant composes for it.

    ``additional_delta`` is delta spent outside the event: partition selection releases a
    partition that only the added unit holds with probability at most ``additional_delta``, and
    no dp_accounting event expresses that. Such a release is within total variation
    ``additional_delta`` of a post-processing of a mechanism that ``event`` describes exactly, so
    a composition is (eps, delta_events(eps) + sum of additional_delta) for every eps.
    """
    value: Any
    event: dp_event.DpEvent
    additional_delta: float = 0.0

    def epsilon(self, delta: float) -> float:
        """The epsilon of this release alone at ``delta`` (dp_accounting's PLD accountant, or RDP
        for events PLD does not support), counting ``additional_delta`` against ``delta``."""
        remaining = delta - self.additional_delta
        if remaining < 0:
            raise ValueError(f"delta {delta} is below this release's additional_delta "
                             f"{self.additional_delta}")
        pld = dp_accounting.pld.PLDAccountant()
        if pld.supports(self.event):
            return pld.compose(self.event).get_epsilon(remaining)
        return dp_accounting.rdp.RdpAccountant().compose(self.event).get_epsilon(remaining)
