"""The privacy-adaptive taxi example (Sage §3.1, §5): `python -m sage_tfx.examples.taxi.run`."""
