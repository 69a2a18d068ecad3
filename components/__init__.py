"""TFX components of sage-tfx, one package each (component.py: spec and class; executor.py: the work)."""
