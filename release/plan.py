"""What a front door asks to pay for, made once from its request: the plan of a release."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from sage_tfx.sage_access.accounting import check_split


@dataclasses.dataclass(frozen=True)
class ReleasePlan:
    """One release's terms, all public (the request and budgets, never the data):

    `front_door`: who asks ("sage-tfx query", "DPAggregate component", ...). `request`: the
    request as the user gave it (SQL, workload spec, pipeline and component), recorded on the
    grant. (`epsilon`, `delta`): the grant, or (`rdp_curve`, `delta`) for a grant of a curve.
    `split` ({step: exact fraction}) and `events`
    ({step: dp-accounting DpEvent}): the DP steps and what each runs. `additional_delta`: delta
    spent outside the events (partition selection's). `pipeline`/`run_id`: what the charge is
    attributed to. `data_uri`/`require_data`: the granted data's location and whether every
    block must have data (the ledger's request options of the same names). `seeded_by`: what
    fixes a seed for the release's noise or sampling (tests only: `charge` refuses it, before
    charging, on a ledger not created for tests)."""
    front_door: str
    request: str
    epsilon: Optional[float]
    delta: Optional[float]
    split: Mapping[str, str]
    events: Mapping[str, object]
    additional_delta: float = 0.0
    rdp_curve: Optional[tuple[float, ...]] = None
    pipeline: Optional[str] = None
    run_id: Optional[str] = None
    data_uri: Optional[str] = None
    require_data: bool = False
    seeded_by: tuple[str, ...] = ()

    def __post_init__(self):
        # A bare grant (`ledger request`) has no split; any other is checked now.
        object.__setattr__(self, "split", check_split(dict(self.split)) if self.split else {})
        object.__setattr__(self, "events", dict(self.events))
        object.__setattr__(self, "seeded_by", tuple(self.seeded_by))

    @classmethod
    def single_step(cls, front_door: str, request: str, step: str, epsilon: float,
                    delta: float, event, **options) -> "ReleasePlan":
        """A plan whose whole budget goes to one step running `event`."""
        return cls(front_door, request, epsilon, delta, {step: "1"}, {step: event}, **options)

    @property
    def steps(self) -> tuple[str, ...]:
        return tuple(self.split)
