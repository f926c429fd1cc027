"""What every foreign drafter format shares (docs/formats.md): the Qwen3-style layer config a portable drafter is built
on, the checks that a drafter can leave dspark at all, and the fields DSparkConfig has in common with the other
DSpark implementations (DeepSpec, vllm-project/speculators, llama.cpp)."""

from __future__ import annotations

from dspark.drafter.backbone import backbone_layout
from dspark.errors import DSparkError

# DSparkConfig fields that DeepSpec and speculators spell the same way.
SHARED_FIELDS = (
    "block_size",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "num_anchors",
)

# Layer-config fields that must agree between a foreign drafter and the Qwen3-style backbone dspark builds for the
# target: they shape the weights or change the arithmetic.
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "attention_bias",
)


def check_portable(drafter, fmt: str) -> None:
    """Refuse, naming the fix, what the foreign format cannot express."""
    config = drafter.config
    if config.architecture != "dspark":
        raise DSparkError(
            f"--format {fmt} writes DSpark drafters; this checkpoint is a '{config.architecture}' "
            "drafter (export it with --format dspark)"
        )
    if config.backbone != "qwen3":
        raise DSparkError(
            f"--format {fmt} needs a Qwen3-style backbone (q/k RMS norms), and this drafter was trained with "
            f"backbone='{config.backbone}' (the target's own layers); continue training it on that backbone with "
            "`dspark train --init-from CHECKPOINT --backbone qwen3 ...`, or train a new one (qwen3 is the default)"
        )
    if config.feature_norm:
        raise DSparkError(
            f"--format {fmt} has no per-layer feature normalisation; this drafter was trained with "
            "--feature-norm, which no other runtime implements. Retrain without it"
        )


def layer_config(target_config) -> dict:
    """The Qwen3 layer config (as a plain dict) of a portable drafter for this target."""
    config, _ = backbone_layout(target_config, "qwen3")
    return config.to_dict()


def rope_theta(layer: dict) -> float:
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta"))
    if theta is None:
        raise DSparkError("the target's config names no rope_theta; its drafter cannot be described to other runtimes")
    return float(theta)


def check_layer_config(foreign: dict, target_config, where: str) -> None:
    """A foreign drafter's decoder layers must be the ones dspark would build for this target."""
    ours = layer_config(target_config)
    for name in LAYER_FIELDS:
        if name in foreign and foreign[name] != ours[name]:
            raise DSparkError(
                f"{where}: {name}={foreign[name]!r}, but the loaded target needs {ours[name]!r}; "
                "this drafter was built for another target"
            )
    if rope_theta(foreign) != rope_theta(ours):
        raise DSparkError(f"{where}: rope_theta {rope_theta(foreign)} differs from the target's {rope_theta(ours)}")
