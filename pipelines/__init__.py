"""Pipeline builders and the privacy-adaptive training driver (see docs/architecture.md)."""
