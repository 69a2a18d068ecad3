"""DP-SQLP: continual release of a DP histogram over an event-time window of a stream, for one
grant per window (Zhang et al., "Differentially Private Stream Processing at Scale").

tree.py holds the DP trees, budget.py the window's calibration and privacy argument,
spec.StreamQuery the query, operator.step one micro-batch on a state.WindowState, and
local.run_local replays a stream durably in-process (a Beam engine calls the same per-key array
functions of operator.py).
"""
