"""A drafter as a llama.cpp draft GGUF (architecture `dflash` with the DSpark Markov and confidence tensors), which
llama.cpp runs as `--spec-type draft-dspark` next to the target's GGUF (docs/formats.md).

llama.cpp shares the target's token embedding (and, for a full draft vocabulary, its output head) at run time, so
neither is written; a reduced draft vocabulary ships its own `output` rows and a `d2t` table of absolute target ids.
The tokenizer metadata is copied from the target's GGUF: llama.cpp refuses a draft whose vocabulary differs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.formats.portable import check_portable, layer_config, rope_theta

ARCH = "dflash"

# dspark state-dict names -> llama.cpp tensor names (per draft layer, then the rest).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def gguf_name(name: str) -> str:
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        if rest in LAYER_NAMES:
            return f"blk.{index}.{LAYER_NAMES[rest]}"
    elif name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    raise DSparkError(f"the drafter tensor '{name}' has no llama.cpp counterpart")


def check_gguf_portable(drafter, target) -> None:
    check_portable(drafter, "gguf")
    config = drafter.config
    if config.markov_rank and config.markov_head_type != "vanilla":
        raise DSparkError(
            f"llama.cpp runs only the vanilla Markov head; this drafter has '{config.markov_head_type}'"
            " (retrain with --markov-head-type vanilla, or serve it with dspark)"
        )
    if config.markov_rank == 0:
        raise DSparkError(
            "llama.cpp's draft-dspark needs a Markov head (markov_rank > 0); a rank-0 drafter is a DFlash drafter"
        )
    if config.enable_confidence_head and not config.confidence_head_with_markov:
        raise DSparkError(
            "llama.cpp's confidence projection reads [h; W1[x]]: export a drafter trained with "
            "--confidence-head-with-markov"
        )
    layers = layer_config(target.config)
    if layers.get("attention_bias"):
        raise DSparkError(
            "llama.cpp's dflash layers have no attention biases, and this target's (Qwen2-style) "
            "drafter layers do; serve it with dspark or vLLM (--format speculators)"
        )
    rope_type = (layers.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise DSparkError(f"the target uses '{rope_type}' RoPE scaling, which this GGUF export does not describe yet")


def _array(tensor: torch.Tensor, dtype: torch.dtype):
    """(numpy array, raw GGML type or None) of a tensor in the export dtype; norms and biases stay float32."""
    from gguf import GGMLQuantizationType

    tensor = tensor.detach().cpu()
    if tensor.dim() == 1 or dtype == torch.float32:
        return tensor.float().numpy(), None
    if dtype == torch.bfloat16:
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), GGMLQuantizationType.BF16
    return tensor.to(dtype).numpy().astype(NUMPY_DTYPES[dtype]), None


def copy_fields(reader, writer, keep) -> None:
    """Every key of the GGUF read whose name `keep` accepts, with its exact type."""
    from gguf import GGUFValueType

    for name, field in reader.fields.items():
        if not keep(name):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)


def read_gguf(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors on files that are not GGUF
        raise DSparkError(f"{path} is not a readable GGUF file ({e}); pass the target's own GGUF") from e


def gguf_weights(path: Path) -> str:
    """The weight type a GGUF file declares (general.file_type), e.g. 'Q4_1'."""
    from gguf import LlamaFileType

    field = read_gguf(path).fields.get("general.file_type")
    if field is None:
        return "as shipped"
    return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def float32_gguf(source: Path, path: Path) -> Path:
    """`source` with every tensor dequantized to float32, written atomically to `path`.

    Our float32 target is dequantized by transformers from the same file, so llama.cpp running this copy does our
    arithmetic: its greedy output and its acceptance of a draft can be compared with ours token for token."""
    from gguf import GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = read_gguf(source)
    arch = reader.fields["general.architecture"].contents()
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(partial), arch)
    copy_fields(
        reader,
        writer,
        lambda name: (
            not name.startswith("GGUF.")
            and name not in ("general.architecture", "general.file_type", "general.quantization_version")
        ),
    )
    writer.add_file_type(LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def export_gguf(drafter, target, out: Path, dtype: torch.dtype, target_gguf: Path) -> Path:
    """Write `out/<name>.gguf`; returns its path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    check_gguf_portable(drafter, target)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DSparkError(f"--format gguf writes float32, float16 or bfloat16 weights, not {dtype}")
    reader = read_gguf(target_gguf)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != target.vocab_size:
        have = "no vocabulary" if tokens is None else f"{len(tokens.data)} tokens"
        raise DSparkError(
            f"{target_gguf} has {have}, but the target has {target.vocab_size}: pass the GGUF of the "
            "same target model with --target-gguf"
        )

    config, layers = drafter.config, layer_config(target.config)
    path = out / f"{target.name}-dspark-draft.gguf"
    writer = GGUFWriter(str(path), ARCH)
    writer.add_name(f"{target.name} DSpark drafter")
    writer.add_context_length(int(layers["max_position_embeddings"]))
    writer.add_embedding_length(int(layers["hidden_size"]))
    writer.add_feed_forward_length(int(layers["intermediate_size"]))
    writer.add_block_count(config.num_draft_layers)
    writer.add_head_count(int(layers["num_attention_heads"]))
    writer.add_head_count_kv(int(layers["num_key_value_heads"]))
    writer.add_key_length(int(layers["head_dim"]))
    writer.add_value_length(int(layers["head_dim"]))
    writer.add_rope_dimension_count(int(layers["head_dim"]))
    writer.add_rope_freq_base(rope_theta(layers))
    writer.add_layer_norm_rms_eps(float(layers["rms_norm_eps"]))
    if drafter.embed_scale is not None:
        writer.add_float32(f"{ARCH}.embedding_scale", drafter.embed_scale)
    writer.add_uint32(f"{ARCH}.block_size", config.block_size)
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in config.target_layer_ids])  # hidden-state indices
    writer.add_bool(f"{ARCH}.sample_from_anchor", True)
    writer.add_bool(f"{ARCH}.has_confidence_head", config.enable_confidence_head)
    copy_fields(reader, writer, lambda name: name.startswith("tokenizer."))  # llama.cpp checks the vocabularies match
    writer.add_uint32("tokenizer.ggml.mask_token_id", config.mask_token_id)

    for name, tensor in drafter.state_dict().items():
        if name == "d2t":
            continue
        array, raw = _array(tensor, dtype)
        writer.add_tensor(gguf_name(name), array, raw_dtype=raw)
    if drafter.d2t is not None:
        array, raw = _array(drafter.lm_weight(torch.float32), dtype)
        writer.add_tensor("output.weight", array, raw_dtype=raw)
        writer.add_tensor("d2t", drafter.d2t.cpu().long().numpy(), raw_dtype=GGMLQuantizationType.I64)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
