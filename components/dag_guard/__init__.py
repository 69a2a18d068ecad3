"""The DAG guard: private records (from the ledger, or derived from them without DP) reach only
components that spend a grant for what they publish. artifacts.py: the private artifact type
TFX's own type check refuses to standard components; guard.py: the check over a DAG, and the
declarations of a custom component DP or of data public (docs/pipelines.md, "The DAG guard")."""
from sage_tfx.components.dag_guard.artifacts import PrivateExamples, PrivateType, is_private
from sage_tfx.components.dag_guard.guard import (DECLARED_DP, DECLARED_PUBLIC, PrivateInput,
                                                 PrivateRecordsRefused, ProducesPrivateRecords,
                                                 check_component, check_pipeline, declare_dp,
                                                 declare_public, replacement)

__all__ = ["DECLARED_DP", "DECLARED_PUBLIC", "PrivateExamples", "PrivateInput",
           "PrivateRecordsRefused", "PrivateType", "ProducesPrivateRecords", "check_component",
           "check_pipeline", "declare_dp", "declare_public", "is_private", "replacement"]
