"""The artifact type of private records, so that TFX itself refuses to hand them to a component
that would publish from them.

TFX checks the type of every input channel when a component is built
(tfx.types.component_spec.ChannelParameter.type_check: the same class, the same class name, or
one of the expected type's `_compatible_types`). PrivateExamples is an Examples subclass with
its own name and TYPE_NAME, so StatisticsGen, Transform, Trainer, Evaluator, ..., and any
`@component` taking `InputArtifact[Examples]`, raise TypeError the moment they are wired to
it, with this type's description (PrivateType.__repr__) naming the DP stand-ins. sage-tfx's
components declare PrivateExamples inputs and, through `_compatible_types`, still accept
public Examples (a DP component may read public data; the grant check decides what it may
charge for).

Kubeflow V2 compiles a custom artifact type only with a TYPE_NAME matching
`^[a-z][a-z0-9-_]{2,20}[.][A-Z][a-zA-Z0-9-_]{2,49}$` and no typed PROPERTIES (STACK.md), so
Examples' properties (split_names, span, version) are custom properties here; Examples' `splits`
and `path()` read them unchanged.
"""
from __future__ import annotations

from tfx.types import standard_artifacts
from tfx.types.artifact import Artifact

# Where a user reads what to do instead (the TypeError TFX raises shows PrivateType's repr).
REPLACEMENTS_IN_BRIEF = ("StatisticsGen -> DPStatisticsGen, Transform -> DPTransform, "
                         "Trainer -> DPTrainer, Evaluator -> SLAedValidator, "
                         "ExampleValidator/SchemaGen -> run on DP statistics")


class PrivateType(type):
    """The metaclass of artifact types holding private records (the DAG guard's marker). Its
    repr is what TFX prints when its type check refuses such a channel."""

    def __repr__(cls) -> str:
        return (f"{cls.TYPE_NAME} (private records from the sage-tfx ledger: only a component "
                f"that spends a grant may read them; {REPLACEMENTS_IN_BRIEF}; a custom "
                "component: sage_tfx.components.declare_dp, see docs/pipelines.md)")


def _custom_property(name: str, kind: type) -> property:
    """Examples' typed property `name`, held as a custom property."""
    get, put = ((Artifact.get_string_custom_property, Artifact.set_string_custom_property)
                if kind is str else
                (Artifact.get_int_custom_property, Artifact.set_int_custom_property))
    return property(lambda self: get(self, name), lambda self, value: put(self, name, value))


class PrivateExamples(standard_artifacts.Examples, metaclass=PrivateType):
    """Examples holding records from the ledger, or derived from them without DP: the Examples
    of BlockExampleGen and BlockLedger, DPTransform's transformed Examples, ObliviousSampleGen's
    samples. Same layout as Examples (`Split-<name>/` under the uri). `PUBLIC_TYPE`: what
    `declare_public` turns a channel of it into."""

    TYPE_NAME = "sage_tfx.PrivateExamples"
    PROPERTIES = {}
    PUBLIC_TYPE = standard_artifacts.Examples
    _compatible_types = frozenset({standard_artifacts.Examples})

    split_names = _custom_property("split_names", str)
    span = _custom_property("span", int)
    version = _custom_property("version", int)


def is_private(artifact_type) -> bool:
    return isinstance(artifact_type, PrivateType)
