"""Hugging Face-style drafter folders of the other DSpark implementations (docs/formats.md):

- `speculators`: vllm-project/speculators' `DSparkSpeculator`, which vLLM serves with `--speculative-config`.
  Target layers are counted as hidden-state indices (`aux_hidden_state_layer_ids` = our decoder-layer ids + 1); a
  reduced draft vocabulary ships `d2t` as offsets (target id − draft id), a `t2d` mask, and its own `lm_head`.
- `deepspec`: DeepSpec's `Qwen3DSparkModel` (`save_pretrained` layout): a Qwen3 config with the DSpark fields, and
  the target's embedding and LM head stored beside the drafter's weights. It has no reduced draft vocabulary.

Both name the drafter's own tensors as dspark does (`layers.N.self_attn.q_proj`, `fc`, `hidden_norm`, `norm`,
`markov_head.markov_w1`, `confidence_head.proj`, ...), so conversion is a renaming of a few extras, not of weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.drafter.config import DSparkConfig
from dspark.errors import DSparkError
from dspark.formats.portable import SHARED_FIELDS, check_layer_config, check_portable, layer_config

SPECULATORS_ARCHITECTURE = "DSparkSpeculator"
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")  # the target's tensors, never trained by the drafter


def _shared(config: DSparkConfig) -> dict:
    return {name: getattr(config, name) for name in SHARED_FIELDS}


def _drafter_tensors(drafter, dtype) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu() for k, v in drafter.state_dict().items() if k != "d2t"}
    return {k: v.to(dtype).contiguous() if v.is_floating_point() else v.contiguous() for k, v in state.items()}


def export_speculators(drafter, target, out: Path, dtype: torch.dtype) -> None:
    check_portable(drafter, "speculators")
    config = drafter.config
    layers = dict(layer_config(target.config), num_hidden_layers=config.num_draft_layers)
    vocab = target.vocab_size
    tensors = _drafter_tensors(drafter, dtype)
    if drafter.d2t is not None:
        d2t = drafter.d2t.cpu().long()
        tensors["d2t"] = d2t - torch.arange(len(d2t))
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, d2t, True)
        tensors["lm_head.weight"] = drafter.lm_weight(dtype).detach().cpu().contiguous()
    meta = {
        "speculators_model_type": "dspark",
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.name, "architectures": list(target.config.architectures or [])},
        },
        "transformer_layer_config": layers,
        "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": target.config.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "sample_from_anchor": True,  # DSpark: the anchor slot predicts the first draft token
        **_shared(config),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


def export_deepspec(drafter, target, out: Path, dtype: torch.dtype) -> None:
    check_portable(drafter, "deepspec")
    config = drafter.config
    if drafter.d2t is not None:
        raise DSparkError(
            "--format deepspec has no reduced draft vocabulary, and this drafter drafts from "
            f"{drafter.draft_vocab_size} of {target.vocab_size} tokens; export it with --format "
            "speculators or gguf, or train with --draft-vocab-size 0 for DeepSpec"
        )
    tensors = _drafter_tensors(drafter, dtype)
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().cpu().to(dtype).contiguous()
    tensors["lm_head.weight"] = target.lm_head.weight.detach().cpu().to(dtype).contiguous()
    meta = dict(layer_config(target.config))
    meta.update(
        architectures=[DEEPSPEC_ARCHITECTURE],
        num_hidden_layers=config.num_draft_layers,
        target_layer_ids=list(config.target_layer_ids),
        tie_word_embeddings=False,
        torch_dtype=str(dtype).removeprefix("torch."),
        **_shared(config),
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")


def detect(path: Path) -> str | None:
    """'speculators', 'deepspec' or None for a folder's config.json."""
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("speculators_model_type") == "dspark":
        return "speculators"
    architectures = meta.get("architectures")
    if isinstance(architectures, list) and DEEPSPEC_ARCHITECTURE in architectures:
        return "deepspec"
    return None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DSparkError(f"{path} has no .safetensors weights")
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                tensors.update({k.removeprefix("model."): f.get_tensor(k) for k in f.keys()})
        except Exception as e:  # safetensors reports damage with its own exception types
            raise DSparkError(f"{file} is damaged or truncated ({e})") from e
    return tensors


def _check_target_tensor(tensors, name: str, expected: torch.Tensor, path: Path) -> None:
    if name in tensors and not torch.equal(tensors[name], expected.detach().cpu().to(tensors[name].dtype)):
        raise DSparkError(
            f"{path}: {name} differs from the loaded target's; this drafter was trained against "
            "other weights of the target (load the exact checkpoint it was trained for)"
        )


def read_foreign(path: Path, target) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """A speculators or DeepSpec DSpark folder as a dspark config and state dict for this target."""
    fmt = detect(path)
    if fmt is None:
        raise DSparkError(
            f"{path} is neither a speculators DSpark folder (speculators_model_type 'dspark') nor a "
            f"DeepSpec one (architectures ['{DEEPSPEC_ARCHITECTURE}'])"
        )
    meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
    where = f"{path}/config.json"
    tensors = _read_tensors(path)
    vocab = target.vocab_size
    try:
        if fmt == "speculators":
            layers = meta["transformer_layer_config"]
            if meta.get("sample_from_anchor") is False:
                raise DSparkError(
                    f"{where}: sample_from_anchor is false (the anchor slot is a bonus token, as in "
                    "DFlash); dspark drafters predict from the anchor slot, so this drafter cannot run here"
                )
            layer_ids = [i - 1 for i in meta["aux_hidden_state_layer_ids"]]
            draft_vocab = int(meta.get("draft_vocab_size") or vocab)
        else:
            layers = meta
            layer_ids = list(meta["target_layer_ids"])
            draft_vocab = vocab
        num_layers = int(layers["num_hidden_layers"])
    except KeyError as e:
        raise DSparkError(f"{where} lacks the field {e}; it is not a complete {fmt} DSpark config") from e
    check_layer_config(layers, target.config, where)
    fields = {k: meta[k] for k in SHARED_FIELDS if k in meta}
    config = DSparkConfig(
        backbone="qwen3",
        num_draft_layers=num_layers,
        target_layer_ids=layer_ids,
        draft_vocab_size=0 if draft_vocab == vocab else draft_vocab,
        **fields,
    )
    config.validate(target.config.num_hidden_layers, vocab)

    if config.draft_vocab_size:
        if "d2t" not in tensors:
            raise DSparkError(f"{path}: draft_vocab_size {draft_vocab} < {vocab} but there is no d2t table")
        offsets = tensors.pop("d2t").long()
        tensors["d2t"] = offsets + torch.arange(len(offsets))
        _check_target_tensor(tensors, "lm_head.weight", target.lm_head.weight[tensors["d2t"]], path)
    else:
        _check_target_tensor(tensors, "lm_head.weight", target.lm_head.weight, path)
    _check_target_tensor(tensors, "embed_tokens.weight", target.embed_tokens.weight, path)
    for name in (*TARGET_OWNED, "t2d"):
        tensors.pop(name, None)
    return config, tensors


EXPORTERS = {"speculators": export_speculators, "deepspec": export_deepspec}
