"""The DSpark drafter: fused target features, KV-injected parallel backbone, sequential and confidence heads."""

from dspark.drafter.config import DSparkConfig
from dspark.drafter.model import DraftCache, DSparkDrafter
from dspark.drafter.registry import (
    NGRAM_PREFIX,
    SUFFIX_PREFIX,
    SUFFIX_SPEC,
    answer_index_of,
    checkpoint_of,
    lineage,
    load_drafter,
    load_proposer,
    model_drafter,
    new_drafter,
    port_to_qwen3,
    read_checkpoint_meta,
    training_totals,
)

__all__ = [
    "NGRAM_PREFIX",
    "SUFFIX_PREFIX",
    "SUFFIX_SPEC",
    "DSparkConfig",
    "DSparkDrafter",
    "DraftCache",
    "answer_index_of",
    "checkpoint_of",
    "lineage",
    "load_drafter",
    "load_proposer",
    "model_drafter",
    "new_drafter",
    "port_to_qwen3",
    "read_checkpoint_meta",
    "training_totals",
]
