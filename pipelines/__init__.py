"""Pipeline builders and the privacy-adaptive training driver (see DESIGN.md)."""
