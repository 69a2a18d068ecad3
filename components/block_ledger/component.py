"""BlockLedger component: a grant from the Sage ledger, emitted with the granted Examples."""
from __future__ import annotations

import json
from typing import Mapping, Optional, Sequence

from tfx.dsl.components.base import base_component, executor_spec
from tfx.types import channel, component_spec

from sage_tfx.components.block_ledger import executor, preflight
from sage_tfx.components.dag_guard import PrivateExamples, ProducesPrivateRecords
from sage_tfx.components.privacy_grant import PrivacyGrant


FIXED_SEEDS = "fixed_seeds"


class BlockLedgerSpec(component_spec.ComponentSpec):
    PARAMETERS = {
        "ledger_store": component_spec.ExecutionParameter(type=str),
        "ledger_context": component_spec.ExecutionParameter(type=str),
        "epsilon": component_spec.ExecutionParameter(type=float),
        "delta": component_spec.ExecutionParameter(type=float),
        "window": component_spec.ExecutionParameter(type=int, optional=True),
        "block_ids": component_spec.ExecutionParameter(type=str, optional=True),
        "split": component_spec.ExecutionParameter(type=str),
        "step_mechanisms": component_spec.ExecutionParameter(type=str, optional=True),
        "pipeline_name": component_spec.ExecutionParameter(type=str, optional=True),
        # What the components this grant pays for check before it is charged (preflight.py);
        # they add themselves (check_before_charge).
        preflight.PROPERTY: component_spec.ExecutionParameter(type=str, optional=True),
        # The consumers that fix a seed (a JSON list; refuse_seed_before_charge): refused before
        # the charge unless the ledger was created for tests.
        FIXED_SEEDS: component_spec.ExecutionParameter(type=str, optional=True),
    }
    INPUTS = {
        # Only orders the DAG (grant after ingestion); the data comes from the ledger's blocks.
        "new_blocks": component_spec.ChannelParameter(type=PrivateExamples,
                                                      optional=True),
    }
    OUTPUTS = {
        "grant": component_spec.ChannelParameter(type=PrivacyGrant),
        "examples": component_spec.ChannelParameter(type=PrivateExamples),
    }


class BlockLedger(ProducesPrivateRecords, base_component.BaseComponent):
    """Requests (epsilon, delta) from the ledger on the most recent `window` blocks that hold
    Examples and can pay (or on explicit `block_ids`, refused if one holds other data), split among the iteration's DP steps by `split`
    ({step: fraction}, fractions summing to at most 1 exactly). `step_mechanisms`
    ({step: {"mechanism": "adassp" | "laplace" | "dp_sgd" | "dp_transform"}}) says what each step runs: the grant
    records each step's DP event (privacy_grant.planned_event), which an rdp ledger charges
    as the RDP curve of their composition. Outputs the PrivacyGrant and one Examples
    artifact (train/test) holding exactly the granted blocks. The charge is linked in MLMD to this
    pipeline run when the ledger lives in the pipeline's metadata store. Before it charges, it
    runs the checks of the components that consume its grant (preflight.py), so a DPTrainer whose
    module does not load, or that needs Keras 2 in a process that has Keras 3, costs nothing.
    """

    SPEC_CLASS = BlockLedgerSpec
    SPENDS_GRANT = True  # may read private records (dag_guard)
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(self, ledger_store: str, epsilon: float, delta: float,
                 window: Optional[int] = None, block_ids: Optional[Sequence[str]] = None,
                 split: Optional[Mapping[str, float]] = None, ledger_context: str = "default",
                 pipeline_name: Optional[str] = None, new_blocks: Optional[channel.Channel] = None,
                 step_mechanisms: Optional[Mapping[str, Mapping]] = None):
        # Refuse here, when the pipeline is built or compiled, not when it runs on a cluster.
        if not (isinstance(epsilon, (int, float)) and epsilon > 0):
            raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
        if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
            raise ValueError(f"delta must be in [0, 1), got {delta!r}")
        if (window is None) == (not block_ids):
            raise ValueError("give exactly one selector: window (most recent W blocks) or "
                             "block_ids")
        if window is not None and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window must be a positive number of blocks, got {window!r}")
        super().__init__(spec=BlockLedgerSpec(
            ledger_store=ledger_store, ledger_context=ledger_context, epsilon=epsilon, delta=delta,
            window=window, block_ids=json.dumps(list(block_ids)) if block_ids else None,
            split=json.dumps(dict(split or {"all": 1.0})), pipeline_name=pipeline_name,
            step_mechanisms=json.dumps(dict(step_mechanisms)) if step_mechanisms else None,
            new_blocks=new_blocks,
            grant=channel.Channel(type=PrivacyGrant),
            examples=channel.Channel(type=PrivateExamples)))


def check_before_charge(grant: channel.Channel, check: preflight.Check) -> None:
    """Have the BlockLedger that produces `grant` run `check` before it charges. A grant from
    elsewhere (no producer in this pipeline) is left alone: its consumer checks on its own."""
    _append_to_producer(grant, preflight.PROPERTY, check.as_dict())


def refuse_seed_before_charge(grant: channel.Channel, seeded_by: str) -> None:
    """Have the BlockLedger that produces `grant` refuse to charge, unless its ledger was
    created for tests (sage_access BlockLedger.refuse_fixed_seed), because a consumer fixes a
    seed (`seeded_by`, e.g. "DPTrainer seed 7"). A grant from elsewhere is left alone: its
    consumer refuses on its own, before it consumes anything (GrantInfo.refuse_fixed_seed)."""
    _append_to_producer(grant, FIXED_SEEDS, seeded_by)


def record_step_mechanism(grant: channel.Channel, step: str, mechanism: Mapping) -> None:
    """Have the BlockLedger that produces `grant` record `mechanism`'s event for `step` (its
    step_mechanisms entry, privacy_grant.planned_event), so the grant charges what the consumer
    will run. ValueError if the BlockLedger names another mechanism for the step. A grant from
    elsewhere is left alone: its consumer checks the recorded event (GrantInfo.check_event)."""
    if isinstance(grant, channel.OutputChannel) and isinstance(grant.producer_component,
                                                                 BlockLedger):
        properties = grant.producer_component.exec_properties
        mechanisms = json.loads(properties.get("step_mechanisms") or "{}")
        if mechanisms.get(step, mechanism) != mechanism:
            raise ValueError(f"the BlockLedger records {mechanisms[step]} for step {step!r}; "
                             f"its consumer runs {mechanism}")
        properties["step_mechanisms"] = json.dumps({**mechanisms, step: dict(mechanism)})


def _append_to_producer(grant: channel.Channel, name: str, value) -> None:
    """Append `value` to the JSON list in execution parameter `name` of the BlockLedger that
    produces `grant` (nothing for a grant from elsewhere)."""
    if isinstance(grant, channel.OutputChannel) and isinstance(grant.producer_component,
                                                                 BlockLedger):
        properties = grant.producer_component.exec_properties
        properties[name] = json.dumps(json.loads(properties.get(name) or "[]") + [value])
