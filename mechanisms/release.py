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
    no dp_accounting event expresses that. A composition is (eps, delta_events(eps) + sum of
    additional_delta) for every eps when, on every neighbouring pair, the release is either
    the independent product of a part that ``event`` describes and a part that is
    (0, additional_delta)-DP (thresholding; basic composition), or a mixture of weight
    1 - additional_delta on a post-processing of ``event`` (truncated geometric; joint
    convexity of the hockey-stick divergence). ``selection`` derives which holds for each rule.
    A one-sided total-variation bound alone would not do: it costs e^eps * additional_delta in
    the other direction.
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
