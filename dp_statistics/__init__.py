"""Differentially private statistics released from granted blocks (beside training)."""
