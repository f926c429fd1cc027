"""Decoding: plain autoregressive reference, speculative engine, verification, policies, statistics."""
