"""MatrixMechanism: a workload of counting queries answered by the matrix mechanism."""
from sage_tfx.components.matrix_mechanism.component import MatrixMechanism, WorkloadAnswers

__all__ = ["MatrixMechanism", "WorkloadAnswers"]
