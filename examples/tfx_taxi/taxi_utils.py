"""The converted template module, importable as `sage_tfx.examples.tfx_taxi.taxi_utils`: the
installed `taxi_utils_native_keras.py` with `taxi_utils_native_keras.diff` applied
(template.py), run as this module's code. A module path serves LocalDagRunner and a compiled
Kubeflow job alike (every task imports it where sage-tfx is installed), while the diff stays
the one file a user reads."""
from sage_tfx.examples.tfx_taxi import template as _template

exec(compile(_template.converted_source(),  # noqa: S102 (the installed template + our diff)
             f"<{_template.MODULE_NAME} converted by {_template.DIFF}>", "exec"))
