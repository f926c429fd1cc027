"""The DSpark drafter: fused target features, KV-injected parallel backbone, sequential and confidence heads."""

from dspark.drafter.config import DSparkConfig
from dspark.drafter.model import DraftCache, DSparkDrafter, Proposal

__all__ = ["DSparkConfig", "DSparkDrafter", "DraftCache", "Proposal"]
