"""A grant checked against the ledger, and the one-time consumption of its steps' shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sage_tfx.sage_access.errors import BadRequest


class GrantError(BadRequest):
    """Examples without a grant that covers them, or a grant the ledger did not issue."""


@dataclass
class GrantInfo:
    """A grant as the ledger recorded it, checked against the PrivacyGrant artifact.

    `share(step)` records the consumption of the step's share in the ledger with one atomic,
    uniquely named MLMD record, so a second trainer or validator on the same share (same DAG,
    a later run, an Importer) is refused.
    """
    grant_id: str
    ledger_store: str
    ledger_context: str
    blocks: tuple[str, ...]
    epsilon: Optional[float]
    delta: Optional[float]
    split: dict[str, str]
    consumer: str
    _ledger: Any = field(repr=False)
    _record: Any = field(repr=False)
    _used: dict = field(default_factory=dict, repr=False)

    @property
    def record(self):
        """The ledger's Grant (what the release protocol's `consume` takes)."""
        return self._record

    @property
    def ledger(self):
        """The ledger that issued the grant, as require_grant opened it (reuse it; do not open
        another)."""
        return self._ledger

    def refuse_fixed_seed(self, component: str, seed: Optional[int]) -> None:
        """Before anything is consumed: with a `seed`, BadRequest unless the grant's ledger was
        created for tests (BlockLedger.refuse_fixed_seed)."""
        if seed is not None:
            self._ledger.refuse_fixed_seed([f"{component} seed {seed}"])

    def share(self, step: str) -> tuple[float, float]:
        """(epsilon, delta) this grant allots to the DP step `step`, consumed in the ledger: the
        first call records the use atomically; any other consumer of this share is refused."""
        if step not in self._used:
            try:
                self._used[step] = self._ledger.use_share(self._record, step, self.consumer)
            except BadRequest as error:
                raise GrantError(str(error)) from None
        return self._used[step]

    def releasing(self, step: str, front_door: str):
        """The release protocol for `step` (sage_tfx.release.consume), entered right after
        consuming the step's share (`share(step)`): call `.released(uris, guarantee)` at the
        end; leaving it by an error records the step `failed` (or `interrupted`)."""
        from sage_tfx import release

        self.share(step)
        return release.consume(self._ledger, self._record, [step], front_door, consumed=[step])

    def event(self, step: str):
        """The dp-accounting event the ledger recorded for `step` (None if it recorded none)."""
        return self._ledger.grant_event(self._record, step)

    def check_event(self, step: str, ran) -> None:
        """Refuse to release unless what ran (`ran`, a DpEvent) is what the grant recorded for
        `step`: the ledger charged the recorded event, so anything else is unaccounted."""
        recorded = self.event(step)
        if recorded is not None and recorded != ran:
            raise GrantError(f"step {step!r} of grant {self.grant_id} ran {ran}, but the ledger "
                             f"recorded and charged {recorded}; nothing was released")

    def record_data(self, uri: str, producer: str) -> None:
        """Record data derived from this grant's Examples at `uri` (see carry_grant)."""
        self._ledger.record_data(self._record, uri, producer)
