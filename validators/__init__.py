"""SLAed validation tests and the SLAedValidator component (see DESIGN.md)."""
