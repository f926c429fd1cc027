"""The training run's configuration: every `dspark train` flag as a field, the presets, and what a resumed run may
change."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from dspark.drafter import DSparkConfig
from dspark.drafter.config import ARCHITECTURES, BACKBONES, HEAD_TYPES
from dspark.errors import DSparkError
from dspark.fsutil import recover_dir

_BASELINE = dict(
    markov_rank=0, markov_head_type="vanilla", enable_confidence_head=False, confidence_head_with_markov=False
)


_EAGLE = dict(
    _BASELINE,
    architecture="eagle3",
    num_draft_layers=1,
    ce_weight=0.1,
    tv_weight=0.9,
    conf_weight=0.0,
    decay=-1 / math.log(0.8),
)  # exp(-(k-1)/λ) = 0.8^(k-1): EAGLE-3's per-step decay


PRESETS = {
    # The paper's drafter: Markov head, confidence head, CE 0.1 + L1 0.9 + confidence 1.0.
    "dspark": dict(
        architecture="dspark",
        block_size=7,
        num_draft_layers=2,
        markov_rank=256,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        ce_weight=0.1,
        tv_weight=0.9,
        conf_weight=1.0,
        decay=4.0,
    ),
    # The DFlash baseline: same backbone, no sequential or confidence head, cross-entropy only.
    "dflash": dict(
        _BASELINE,
        architecture="dspark",
        block_size=7,
        num_draft_layers=2,
        ce_weight=1.0,
        tv_weight=0.0,
        conf_weight=0.0,
        decay=4.0,
    ),
    # EAGLE-3-style autoregressive drafter trained with training-time test over γ steps (docs/design.md §6).
    "eagle3": dict(_EAGLE, block_size=7),
    # MTP-1: one draft token per round.
    "mtp1": dict(_EAGLE, block_size=1),
}


def opt(default, help: str, **cli):
    """A TrainConfig field with the help text (and choices / flag name) its command-line flag is derived from."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, **cli}, **factory)


@dataclass
class TrainConfig:
    data: str = opt("", "training JSONL (regenerated chat records from `dspark regenerate`)")
    out: str = opt("", "run folder: checkpoint/, metrics.jsonl")
    model: str = opt("smollm2-135m-instruct", "target: a known name or a Hugging Face model folder")
    target_dtype: str = opt(
        "auto",
        "precision of the frozen target; auto: bfloat16 where it is native (a GPU, a CPU "
        "with AMX / AVX-512-BF16), else float32",
        choices=("auto", "float32", "bfloat16"),
    )
    preset: str = opt("dspark", "architecture and loss preset", choices=tuple(PRESETS))
    # drafter (docs/design.md §2); None = the preset's value
    architecture: str | None = opt(None, "drafter architecture (set by --preset)", choices=ARCHITECTURES)
    block_size: int | None = opt(None, "γ: draft positions per round")
    num_draft_layers: int | None = opt(None, "backbone decoder layers")
    markov_rank: int | None = opt(None, "rank of the sequential head (0 = pure parallel, DFlash)")
    widen_markov_rank: int = opt(
        0, "with --init-from, widen the continued drafter's vanilla Markov head to this rank (0 = keep it)"
    )
    markov_head_type: str | None = opt(None, "sequential head", choices=HEAD_TYPES)
    enable_confidence_head: bool | None = opt(None, "train a confidence head", flag="confidence-head")
    confidence_head_with_markov: bool | None = opt(None, "the confidence head also sees the Markov embedding")
    draft_vocab_size: int = opt(
        0,
        "score only the N most frequent answer tokens (0 = the whole vocabulary); with "
        "--init-from, widen the continued drafter's to N (0 = keep it)",
    )
    feature_norm: bool = opt(False, "RMS-normalise each captured target layer before fc")
    backbone: str = opt(
        "qwen3",
        "draft layers: qwen3 (RMSNorm on q and k; portable: exports to llama.cpp, vLLM, "
        "DeepSpec), or the target's own family",
        choices=BACKBONES,
    )
    target_layer_ids: list[int] = opt(list, "target layers fed to the drafter, e.g. 1,8,14,21,28")
    mask_token_id: int = opt(-1, "the block's mask token (-1 = an unused token of the target)")
    init_target_layers: bool = opt(True, "start the backbone from the target's top decoder layers")
    markov_init: str = opt(
        "zero",
        "start of the Markov head: zero (the pure parallel drafter) or bigram (a low-rank "
        "factorisation of the data's bigram log-probabilities)",
        choices=("zero", "bigram"),
    )
    init_from: str | None = opt(None, "continue training an existing drafter checkpoint")
    add_draft_layers: int = opt(
        0,
        "with --init-from, deepen the continued drafter by N decoder layers after its last "
        "(each an identity at the start, so it proposes as before; trained at the full "
        "learning rate)",
    )
    # loss (docs/design.md §3); None = the preset's value
    ce_weight: float | None = opt(None, "weight of the cross-entropy term")
    tv_weight: float | None = opt(None, "weight of the L1 (2·TV) term against the target distribution")
    conf_weight: float | None = opt(None, "weight of the confidence BCE term")
    decay: float | None = opt(None, "position weight exp(-(k-1)/decay); <= 0 disables")
    target_topk: int = opt(0, "keep the target distribution's top K (0 = full)")
    num_anchors: int = opt(64, "blocks sampled per training sequence")
    rollout_anchors: float = opt(
        0.0,
        "share of each sequence's blocks anchored where greedy decoding with the current "
        "drafter would start a round (one past each round's accepted drafts), the rest "
        "uniform; costs a no-grad drafter pass over every answer position",
    )
    max_length: int = opt(1024, "tokens per training sequence (longer ones are cut)")
    allow_foreign_data: bool = opt(False, "train on data regenerated by another target (normally refused)")
    # optimisation
    epochs: float = opt(1.0, "passes over the data")
    max_steps: int = opt(0, "stop after this many steps (> 0 overrides --epochs)")
    max_minutes: float = opt(
        0.0,
        "fit the run into this many minutes of training steps (loading and evaluations "
        "not counted): after 10 steps their measured time sets the schedule's length, at "
        "most what --max-steps / --epochs ask; 0 = off",
    )
    batch_size: int = opt(8, "sequences per micro-batch and process")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    lr: float = opt(6e-4, "peak learning rate (warmup, then cosine)")
    warmup_ratio: float = opt(0.04, "share of the steps spent warming up")
    weight_decay: float = opt(0.0, "AdamW weight decay (never on norms and biases)")
    copied_lr_scale: float = opt(
        1.0,
        "learning-rate multiplier for the backbone's decoder layers and final norm, the "
        "parts started from the target's top layers (1 = the same rate as the rest)",
    )
    clip: float = opt(1.0, "gradient norm clip")
    bf16: bool | None = opt(
        None,
        "autocast the drafter to bfloat16 (fp32 master weights); default: where bfloat16 is "
        "native, as for --target-dtype auto",
    )
    device: str = opt("auto", "auto (this rank's GPU if CUDA is available, else the CPU), cpu or cuda:N")
    feature_cache: str | None = opt(None, "folder for the on-disk target feature cache (built on first use)")
    holdout: float = opt(0.02, "share of records held out for evaluation")
    decode_eval_every: int = opt(
        0,
        "every N steps also decode a fixed slice of each evaluation set for real "
        "(greedy, fixed γ; τ per set in metrics.jsonl); 0 = off",
    )
    decode_eval_sets: list[str] = opt(
        lambda: ["gsm8k", "humaneval", "mt-bench", "math500", "mbpp"],
        "evaluation sets of the real-decoding evaluation, comma-separated names or JSONL paths",
    )
    decode_eval_prompts: int = opt(1, "prompts per set in the real-decoding evaluation (the first ones)")
    decode_eval_tokens: int = opt(48, "new tokens per prompt in the real-decoding evaluation")
    eval_every: int = opt(200, "steps between held-out evaluations")
    save_every: int = opt(200, "steps between checkpoints")
    seed: int = opt(0, "random seed")

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise DSparkError(f"unknown preset '{self.preset}'; use one of {', '.join(PRESETS)}")
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for name in (
            "batch_size",
            "grad_accum",
            "num_anchors",
            "max_length",
            "eval_every",
            "save_every",
            "block_size",
            "num_draft_layers",
        ):
            if getattr(self, name) <= 0:
                raise DSparkError(f"--{flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("decode_eval_prompts", "decode_eval_tokens"):
            if getattr(self, name) <= 0:
                raise DSparkError(f"--{flag(name)} must be positive, got {getattr(self, name)}")
        for name in (
            "markov_rank",
            "draft_vocab_size",
            "target_topk",
            "max_steps",
            "decode_eval_every",
            "add_draft_layers",
            "widen_markov_rank",
        ):
            if getattr(self, name) < 0:
                raise DSparkError(f"--{flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in (
            "lr",
            "epochs",
            "max_minutes",
            "weight_decay",
            "copied_lr_scale",
            "clip",
            "ce_weight",
            "tv_weight",
            "conf_weight",
            "decay",
            "warmup_ratio",
            "holdout",
        ):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise DSparkError(f"--{flag(name)} must be a finite number, got {value}")
            if name != "decay" and value < 0:
                raise DSparkError(f"--{flag(name)} must be >= 0, got {value}")
        if self.lr <= 0 or self.clip <= 0:
            raise DSparkError(f"--lr and --clip must be positive, got {self.lr} and {self.clip}")
        if not 0 <= self.rollout_anchors <= 1:
            raise DSparkError(
                f"--rollout-anchors is a share of the anchors: between 0 and 1, got {self.rollout_anchors}"
            )
        if self.warmup_ratio >= 1 or self.holdout >= 1:
            raise DSparkError("--warmup-ratio and --holdout are shares: each must be below 1")
        if self.add_draft_layers and not self.init_from:
            raise DSparkError(
                "--add-draft-layers deepens a trained drafter: give it with --init-from; a new drafter "
                "takes its depth from --num-draft-layers"
            )
        if self.widen_markov_rank and not self.init_from:
            raise DSparkError(
                "--widen-markov-rank widens a trained drafter: give it with --init-from; a new drafter takes its "
                "rank from --markov-rank"
            )
        if self.max_steps <= 0 and self.epochs <= 0:
            raise DSparkError("train for something: --epochs > 0 or --max-steps > 0")

    def drafter_config(self) -> DSparkConfig:
        return DSparkConfig(
            architecture=self.architecture,
            block_size=self.block_size,
            num_draft_layers=self.num_draft_layers,
            target_layer_ids=list(self.target_layer_ids),
            markov_rank=self.markov_rank,
            markov_head_type=self.markov_head_type,
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov,
            num_anchors=self.num_anchors,
            draft_vocab_size=self.draft_vocab_size,
            feature_norm=self.feature_norm,
            mask_token_id=self.mask_token_id,
            backbone=self.backbone,
        )

    def for_device(self, device: torch.device) -> TrainConfig:
        """--target-dtype auto and an unset --bf16 decided for `device`: bfloat16 where it is native, else float32
        (emulated bfloat16 made a training step 5.5x slower than float32 on an AVX2-only EPYC)."""
        from dspark.autotune import native_bf16_flags

        native = device.type == "cuda" or bool(native_bf16_flags())
        return replace(
            self,
            target_dtype=("bfloat16" if native else "float32") if self.target_dtype == "auto" else self.target_dtype,
            bf16=native if self.bf16 is None else self.bf16,
        )

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# Settings a resumed run may change: how long it runs, how often it reports, where and in what precision it computes,
# and its data, which may only grow by appended records (checked on resume), not what it learns from them.
RESUMABLE = (
    "epochs",
    "max_steps",
    "max_minutes",
    "eval_every",
    "save_every",
    "device",
    "target_dtype",
    "bf16",
    "feature_cache",
    "data",
    "decode_eval_every",
    "decode_eval_sets",
    "decode_eval_prompts",
    "decode_eval_tokens",
)


def resumed_config(out: str | Path, overrides: dict) -> TrainConfig:
    """The configuration of the run in `out`, with the given settings changed where a resumed run allows it."""
    saved = Path(out) / "checkpoint" / "trainer_state.json"
    recover_dir(saved.parent)
    if not saved.exists():
        raise DSparkError(f"--resume: {saved} does not exist; start the run without --resume")
    try:
        data = json.loads(saved.read_text())["train_config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DSparkError(f"--resume: {saved} is unreadable ({e}); the checkpoint is damaged") from e
    data.setdefault("backbone", "family")  # runs saved before the field existed used the target's family
    cfg = TrainConfig.from_dict(data)
    changed = {k: v for k, v in overrides.items() if getattr(cfg, k) != v}
    refused = sorted(k for k in changed if k not in RESUMABLE)
    if refused:
        raise DSparkError(
            f"--resume continues the run as it was configured; {', '.join('--' + flag(k) for k in refused)} "
            f"would change what it learns. Only {', '.join('--' + flag(k) for k in RESUMABLE)} may change; "
            "start a new run with --init-from to change the rest"
        )
    return replace(cfg, out=str(out), **changed)


def flag(name: str) -> str:
    return name.replace("_", "-")
