"""Which components may read private records, checked over a DAG before anything runs.

A component may read a channel of a private type (artifacts.PrivateType: PrivateExamples,
ContinualReleaseState) only if it spends a grant for what it publishes:
* sage-tfx's components, whose class says so (`SPENDS_GRANT = True`; each one's docstring gives
  its guarantee);
* a custom component declared DP with `declare_dp(component_or_class, guarantee=...)`; the
  guarantee is recorded as its exec property `sage_tfx_declared_dp`, so the compiled pipeline
  and its execution in ML Metadata carry it.
Nodes that are not components (TFX's Resolver) only pass artifact references on; what they
output keeps the private type and is checked where it is read. `declare_public(channel,
reason=...)` says that a channel's records are in fact public: the channel becomes plain
Examples (any component may read it) and the reason is recorded on its producer
(`sage_tfx_declared_public`).

Where the check runs:
1. TFX's own type check when a component is built (artifacts.py): every standard component
   and any `@component` typed `InputArtifact[Examples]`;
2. when a tfx Pipeline is built: sage-tfx's producers of private records check each component
   TFX links downstream of them (ProducesPrivateRecords.add_downstream_node, which TFX's
   Pipeline calls for every data dependency), whatever runner runs the pipeline later;
3. `check_pipeline`, over every channel of the pipeline (through Resolvers too), which
   `sage_tfx.pipelines.run_local`, `sage-tfx compile` (pipelines/kubeflow.py) and the adaptive
   driver run before anything runs.
Standard components are recognised by their TFX spec (tfx.types.standard_component_specs),
which imports without TFDV, or by their class name, never by importing them.
"""
from __future__ import annotations

import json
from typing import Iterator, NamedTuple, Optional

from tfx.dsl.components.base import base_component
from tfx.types import channel, standard_component_specs as specs

from sage_tfx.components.dag_guard.artifacts import is_private
from sage_tfx.sage_access.errors import BadRequest

DECLARED_DP = "sage_tfx_declared_dp"
DECLARED_PUBLIC = "sage_tfx_declared_public"
_CLASS_GUARANTEE = "_sage_tfx_dp_guarantee"

_ON_DP_STATISTICS = "run it on DP statistics (DPStatisticsGen's output)"
# (standard spec, component class name, what to use instead).
_REPLACEMENTS = (
    (specs.StatisticsGenSpec, "StatisticsGen", "DPStatisticsGen"),
    (specs.TransformSpec, "Transform", "DPTransform"),
    (specs.TrainerSpec, "Trainer", "DPTrainer"),
    (specs.TunerSpec, "Tuner", "DPTrainer (tune hyperparameters on public data)"),
    (specs.EvaluatorSpec, "Evaluator", "SLAedValidator"),
    (specs.ExampleValidatorSpec, "ExampleValidator", _ON_DP_STATISTICS),
    (specs.SchemaGenSpec, "SchemaGen", _ON_DP_STATISTICS),
)
_HOW_TO_DECLARE = (
    "A custom component that is DP can be declared so, with its guarantee: "
    "sage_tfx.components.declare_dp(component, guarantee=...) (recorded in the pipeline and "
    "its ML Metadata); records that are in fact public: declare_public(channel, reason=...). "
    "See docs/pipelines.md, \"The DAG guard\".")


class PrivateRecordsRefused(BadRequest):
    """A component that does not spend a grant is wired to read private records."""


class PrivateInput(NamedTuple):
    component: str       # the consumer's id
    input_key: str
    source: str          # "<producer id>.<output key>" (or the channel's type name)
    allowed_because: str


def replacement(component) -> Optional[str]:
    """The DP stand-in of a standard TFX component (by its spec or class name), else None."""
    for spec_class, name, instead in _REPLACEMENTS:
        if isinstance(getattr(component, "spec", None), spec_class) or \
                type(component).__name__ == name:
            return instead
    return None


def declare_dp(component, guarantee: str):
    """Declare a custom component (a class, e.g. what `@component` returns, or one instance) DP:
    it may read private records, and `guarantee` says what makes what it publishes DP (e.g.
    "each count is epsilon-DP: Laplace noise paid by the grant's 'counts' share"). Recorded as
    the exec property `sage_tfx_declared_dp` of every instance the guard lets through. Returns
    `component`."""
    if not (isinstance(guarantee, str) and guarantee.strip()):
        raise ValueError("declare_dp needs the component's guarantee: a sentence saying what "
                         "makes what it publishes DP")
    if isinstance(component, type):
        setattr(component, _CLASS_GUARANTEE, guarantee)
    elif isinstance(component, base_component.BaseComponent):
        component.exec_properties[DECLARED_DP] = guarantee
    else:
        raise TypeError(f"declare_dp takes a TFX component or component class, got {component!r}")
    return component


def declare_public(output: channel.OutputChannel, reason: str) -> channel.OutputChannel:
    """Declare the records of a private channel public (e.g. blocks holding a public data set):
    the channel becomes its public type (PrivateExamples -> Examples) for the components built
    on it afterwards, and `reason` is recorded on its producer (exec property
    `sage_tfx_declared_public`, {output key: reason}). Returns the channel."""
    if not (isinstance(reason, str) and reason.strip()):
        raise ValueError("declare_public needs the reason the records are public")
    if not (isinstance(output, channel.OutputChannel) and is_private(output.type)):
        raise TypeError(f"declare_public takes a component's output channel of private records, "
                        f"got {output!r}")
    public = getattr(output.type, "PUBLIC_TYPE", None)
    if public is None:
        raise ValueError(f"{output.type.TYPE_NAME} is private state, never public data")
    properties = output.producer_component.exec_properties
    declared = json.loads(properties.get(DECLARED_PUBLIC) or "{}")
    properties[DECLARED_PUBLIC] = json.dumps({**declared, output.output_key: reason},
                                             sort_keys=True)
    output.type = public
    return output


def _source(input_channel) -> str:
    if isinstance(input_channel, channel.OutputChannel):
        return f"{input_channel.producer_component_id}.{input_channel.output_key}"
    return input_channel.type.TYPE_NAME


def _private_inputs(node, producer_id: Optional[str]) -> Iterator[tuple[str, object]]:
    for key, input_channel in node.inputs.items():
        if is_private(input_channel.type) and (
                producer_id is None
                or producer_id in input_channel.get_data_dependent_node_ids()):
            yield key, input_channel


def check_component(node, producer_id: Optional[str] = None) -> list[PrivateInput]:
    """The private inputs of `node` (those from `producer_id` only, when given) and why each
    is allowed; PrivateRecordsRefused naming the component, its input and the DP stand-in if
    any is not. A class-level declare_dp is recorded on the instance here."""
    if not isinstance(node, base_component.BaseComponent):
        return []  # a Resolver passes references on; its outputs are checked where read
    private = list(_private_inputs(node, producer_id))
    if not private:
        return []
    declared = node.exec_properties.get(DECLARED_DP) or getattr(node, _CLASS_GUARANTEE, None)
    if getattr(node, "SPENDS_GRANT", False):
        because = "spends a grant"
    elif declared:
        node.exec_properties[DECLARED_DP] = declared
        because = f"declared DP: {declared}"
    else:
        instead = replacement(node)
        lines = [f"{node.id} ({type(node).__name__}) reads private records on its input "
                 f"{key!r} (from {_source(input_channel)}) and spends no grant for what it "
                 f"publishes" + (f": use {instead} instead" if instead else "")
                 for key, input_channel in private]
        raise PrivateRecordsRefused("; ".join(lines) + ". " + _HOW_TO_DECLARE)
    return [PrivateInput(node.id, key, _source(input_channel), because)
            for key, input_channel in private]


def check_pipeline(pipeline) -> list[PrivateInput]:
    """Every private input of the pipeline's components and why it is allowed; raises
    PrivateRecordsRefused (a BadRequest) naming each component that may not read one, before
    anything runs or is charged."""
    allowed, refusals = [], []
    for node in pipeline.components:
        try:
            allowed += check_component(node)
        except PrivateRecordsRefused as refused:
            refusals.append(str(refused).removesuffix(" " + _HOW_TO_DECLARE))
    if refusals:
        raise PrivateRecordsRefused(
            f"pipeline {pipeline.pipeline_info.pipeline_name!r}: " + " ".join(refusals)
            + f" Nothing ran and nothing was charged. {_HOW_TO_DECLARE}")
    return allowed


class ProducesPrivateRecords:
    """Mixin of the sage-tfx components whose outputs hold private records: TFX's Pipeline
    links each data dependency through `add_downstream_node` when it is built, and this checks
    the component being linked (check_component), so a plain tfx Pipeline refuses a consumer
    that spends no grant, whatever runner would run it."""

    def add_downstream_node(self, downstream_node):
        check_component(downstream_node, producer_id=self.id)
        super().add_downstream_node(downstream_node)
