"""dspark: DSpark speculative decoding (semi-autoregressive drafter + confidence-scheduled verification)."""

__version__ = "0.1.0"
