"""The parallel backbone: fused target features injected as extra keys/values into decoder layers
(docs/design.md §2.1, §2.3).

The layers are HF decoder-layer modules, so weights carry the usual names (`layers.N.self_attn.q_proj` ...) and can
be initialised from the target's layers; only their forward is ours: queries come from the block, keys and values
from cat(context, block). `backbone="family"` uses the target's own family; `backbone="qwen3"` uses Qwen3-style
layers (RMSNorm on q and k) sized from the target, whatever its family: the portable layout other runtimes load.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from dspark.decoder import attention, rotate
from dspark.errors import DSparkError


def backbone_layout(target_config, backbone: str):
    """(layer config, (DecoderLayer, RMSNorm, RotaryEmbedding)) of a drafter backbone for this target."""
    if backbone == "family":
        return target_config, family_classes(target_config)
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as q3

    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None)
    if rope and "full_attention" in rope:  # Gemma 3 ropes its global and sliding layers apart: take the global one
        rope = rope["full_attention"]
    config = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=target_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        hidden_act=getattr(target_config, "hidden_activation", None) or target_config.hidden_act,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
        attention_bias=bool(getattr(target_config, "attention_bias", False)) or target_config.model_type == "qwen2",
        initializer_range=getattr(target_config, "initializer_range", 0.02),
    )
    return config, (q3.Qwen3DecoderLayer, q3.Qwen3RMSNorm, q3.Qwen3RotaryEmbedding)


def family_classes(target_config):
    """(DecoderLayer, RMSNorm, RotaryEmbedding) classes of the target's model family."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = target_config.model_type
    base = MODEL_MAPPING_NAMES.get(model_type)
    if not isinstance(base, str) or not base.endswith("Model"):
        raise DSparkError(f"the drafter backbone does not know the '{model_type}' model family")
    prefix = base[: -len("Model")]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    try:
        return tuple(getattr(module, prefix + suffix) for suffix in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))
    except AttributeError as e:
        raise DSparkError(f"the drafter backbone does not support the '{model_type}' family yet: {e}") from e


def check_layer_layout(layer: nn.Module, model_type: str) -> None:
    """The KV-injection forward below is written for pre-norm decoders with two norms (Llama, Qwen2/3, Mistral)."""
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    extra = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    if not all(hasattr(layer, n) for n in needed) or any(hasattr(layer, n) for n in extra):
        raise DSparkError(
            f"the '{model_type}' decoder layer layout is not supported by the drafter backbone yet "
            "(supported: pre-norm layers with input_layernorm/post_attention_layernorm, e.g. Llama, Qwen2, Qwen3)"
        )


def _heads(attn, x: torch.Tensor, proj: nn.Module, norm: nn.Module | None = None) -> torch.Tensor:
    """Project x [B, L, d] to heads [B, H, L, hd], with the family's per-head norm where it has one (Qwen3)."""
    out = proj(x).unflatten(-1, (-1, attn.head_dim))
    if norm is not None:
        out = norm(out)
    return out.transpose(1, 2)


def context_kv(layer: nn.Module, ctx: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values that one draft layer reads from the fused context ctx [B, L, d]."""
    attn = layer.self_attn
    k = rotate(_heads(attn, ctx, attn.k_proj, getattr(attn, "k_norm", None)), cos, sin)
    v = _heads(attn, ctx, attn.v_proj)
    return k, v


def layer_forward(layer: nn.Module, x: torch.Tensor, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
    """One draft decoder layer: block queries over cat(context, block) keys/values; mask [B, 1, Q, Lctx + Q]."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q = rotate(_heads(attn, h, attn.q_proj, getattr(attn, "q_norm", None)), cos, sin)
    k = rotate(_heads(attn, h, attn.k_proj, getattr(attn, "k_norm", None)), cos, sin)
    v = _heads(attn, h, attn.v_proj)
    k = torch.cat([ctx_k, k], dim=2)
    v = torch.cat([ctx_v, v], dim=2)
    out = attention(q, k, v, mask, attn.scaling)
    x = x + attn.o_proj(out.transpose(1, 2).flatten(2))
    return x + layer.mlp(layer.post_attention_layernorm(x))
