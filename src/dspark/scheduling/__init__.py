"""Confidence-scheduled verification support (docs/design.md §5): the engine's cost table and confidence calibration."""
