"""Confidence-scheduled verification support (SPEC §5): the engine's cost table and confidence calibration."""
