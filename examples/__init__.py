"""Runnable examples that ship with sage-tfx."""
