"""What support/task_entrypoint.py imports at its top level (a launcher imports it first)."""
