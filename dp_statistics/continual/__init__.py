"""Continual release over streams: the DP-SQLP operator (issue 19; Zhang et al. 2023).

``spec.StreamQuery`` is the query, ``budget.plan`` calibrates it, ``operator.step`` runs one
micro-batch on a ``state.WindowState`` and ``local.run_local`` replays a stream durably
in-process (a Beam engine calls the same per-key array functions of operator.py).
"""
