"""`dspark train`: the drafter's training loop, read top to bottom (docs/design.md §3).

Per step: a batch of sequences -> target features (online, or from the feature cache) -> anchors and supervised
block positions -> the drafter's forward over all blocks -> the three-term loss -> AdamW with warmup + cosine.
Runs alone or under torchrun (DDP; gloo on CPU). Checkpoints are atomic and hold everything `--resume` needs to
continue exactly: weights, optimizer moments, schedule position, random state and data position. No pickle.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dspark.drafter import DSparkConfig, lineage, load_drafter, new_drafter, port_to_qwen3, read_checkpoint_meta
from dspark.drafter.config import ARCHITECTURES, BACKBONES, HEAD_TYPES
from dspark.errors import DSparkError
from dspark.fsutil import atomic_dir, atomic_write_text, recover_dir
from dspark.target import resolve_device
from dspark.training.anchors import (
    block_supervision,
    leading_runs,
    position_weights,
    rounds_by_row,
    sample_anchors,
    visited_anchors,
)
from dspark.training.data import Example, examples_from_record, read_records, spread_slice
from dspark.training.features import CachedFeatures, OnlineFeatures, TargetBatch, build_feature_cache
from dspark.training.loss import LossWeights, dspark_loss

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


# ---- distributed --------------------------------------------------------------------------------------------------
def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device): NCCL across GPUs, gloo across CPU processes."""
    dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", 0)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dev
    return 0, 1, dev


def all_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def return_freed_memory() -> None:
    """Give the memory the C allocator holds free back to the system. glibc keeps the freed blocks of each step's
    variably shaped tensors: a CPU run grew ~40 MB a step and was killed for memory at 12 GB. Trimming every ten
    steps cost no measurable time and held it at 4.1 GB where it had reached 6.0 GB by step 76. A no-op where the C
    library has no malloc_trim (not glibc)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- data ---------------------------------------------------------------------------------------------------------
def load_examples(
    target, path: str, max_length: int, holdout: float, allow_foreign: bool = False
) -> tuple[list[Example], list[Example], list]:
    """Training and held-out examples, and the record ids in file order; the hold-out is a fixed slice chosen by
    record id. Records regenerated by another target are refused (the drafter would learn to imitate the wrong
    model), and so are token ids outside the target's vocabulary."""
    train, held, record_ids = [], [], []
    fingerprint = target.fingerprint
    for record in read_records(path):
        if not any(m["role"] == "assistant" for m in record["messages"]):
            raise DSparkError(f"{path}: record {record['id']} has no assistant answer; run `dspark regenerate` first")
        source = record.get("target")
        if isinstance(source, dict) and source.get("fingerprint") not in (None, fingerprint) and not allow_foreign:
            raise DSparkError(
                f"{path}: record {record['id']} was regenerated by target '{source.get('name_or_path')}' "
                f"(fingerprint {source.get('fingerprint')}), not by '{target.name}' ({fingerprint}). Regenerate the "
                "data with this target, or pass --allow-foreign-data to train on it anyway"
            )
        ids = [t for turn in record.get("assistant_token_ids") or [] for t in turn]
        if ids and max(ids) >= target.vocab_size:
            raise DSparkError(
                f"{path}: record {record['id']} holds token id {max(ids)}, outside the target's "
                f"vocabulary of {target.vocab_size}; the data belongs to another tokenizer"
            )
        bucket = held if (hash_id(record["id"]) % 10000) < holdout * 10000 else train
        bucket.extend(examples_from_record(target.tokenizer, record, max_length))
        record_ids.append(record["id"])
    if not train:
        raise DSparkError(f"{path}: no training examples with at least two assistant tokens")
    for i, e in enumerate(train):
        e.index = i
    return train, held, record_ids


def data_seen(record_ids: list, train_examples: int) -> dict:
    """What a checkpoint remembers of its data: how many records (and a digest of their ids, in order) and how many
    training examples they gave, so a resumed run can tell appended data from changed data."""
    return {"records": len(record_ids), "ids_crc32": hash_id(json.dumps(record_ids)), "train_examples": train_examples}


def continue_on_data(loop: dict, record_ids: list, train_examples: int, old_data: str | None) -> int:
    """Check that the data of a resumed run begins with the records it trained on, and say how many training
    examples were appended since (they join from the next epoch on). Checkpoints written before the data was
    remembered are checked against their own data file, where it still exists."""
    seen = loop.get("data")
    if seen is None and old_data and Path(old_data).exists():
        old_ids = [r["id"] for r in read_records(old_data)]
        seen = {**data_seen(old_ids, train_examples), "train_examples": None}
    if seen is not None:
        n = seen["records"]
        if len(record_ids) < n or hash_id(json.dumps(record_ids[:n])) != seen["ids_crc32"]:
            raise DSparkError(
                f"--resume --data: the run was trained on {n} records, and this data does not begin "
                "with them in the same order. A resumed run can only take data appended after what it "
                "saw; start a new run (--init-from the checkpoint) to train on other data"
            )
    before = (seen or {}).get("train_examples") or train_examples
    return train_examples - before


def hash_id(text) -> int:
    import zlib

    return zlib.crc32(str(text).encode())


def epoch_batches(examples: list[Example], batch_size: int, epoch: int, seed: int) -> list[list[int]]:
    """Batches of similar length (little padding), in a random order that depends only on (seed, epoch)."""
    rng = random.Random(seed * 1000003 + epoch)
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches = []
    group = batch_size * 32
    for g in range(0, len(order), group):
        chunk = sorted(order[g : g + group], key=lambda i: len(examples[i]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def answer_token_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        answer = torch.tensor([t for t, m in zip(e.input_ids, e.loss_mask) if m], dtype=torch.long)
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def draft_vocabulary(examples: list[Example], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent assistant tokens (sorted ids) and the share of assistant tokens they cover."""
    counts = answer_token_counts(examples, vocab_size)
    top = counts.topk(size).indices.sort().values
    return top, float(counts[top].sum() / counts.sum().clamp_min(1))


def widen_draft_vocabulary(drafter, examples: list[Example], size: int, vocab_size: int) -> tuple[float, float]:
    """`--draft-vocab-size` on a continued drafter: add the most frequent answer tokens it lacks until it has `size`
    (a vocabulary chosen from early data can miss much of later data: the shipped drafter's 8,192 tokens, taken from a
    math-and-code set, missed 10 % of the tokens of assistant answers). Returns the share of answer tokens covered
    before and after."""
    have = drafter.draft_vocab_size
    if drafter.d2t is None or size < have:
        raise DSparkError(
            f"--draft-vocab-size {size}: the drafter being continued scores {have} tokens, and a "
            "vocabulary can only grow (its Markov rows are learned); pass a size >= it, or 0 to keep it"
        )
    counts = answer_token_counts(examples, vocab_size)
    covered = lambda: float(counts[drafter.d2t].sum() / counts.sum().clamp_min(1))
    before = covered()
    missing = counts.clone()
    missing[drafter.d2t] = -1
    drafter.widen_draft_vocab(torch.sort(missing, descending=True, stable=True).indices[: size - have])
    return before, covered()


def init_markov_from_bigrams(drafter, examples: list[Example], max_rows: int = 8192, smoothing: float = 0.5) -> float:
    """Start the Markov head at a rank-r factorisation of the bigram log-probabilities of the answers: B(prev) ≈
    log P(next | prev) − mean over next, for the `max_rows` most frequent previous tokens (the others start at zero).
    Identical on every DDP rank (same data, deterministic SVD). Returns the share of the centred matrix's energy kept."""
    head = drafter.markov_head
    vocab, rank = head.markov_w1.num_embeddings, drafter.config.markov_rank
    t2d = drafter.t2d()
    pairs = []
    for e in examples:
        ids, mask = torch.tensor(e.input_ids), torch.tensor(e.loss_mask, dtype=torch.bool)
        inside = mask[:-1] & mask[1:]  # both are answer tokens, as an anchor and its next token are
        pairs.append(torch.stack([ids[:-1][inside], ids[1:][inside]]))
    prev, nxt = torch.cat(pairs, dim=1)
    if t2d is not None:
        nxt = t2d[nxt]
        prev, nxt = prev[nxt >= 0], nxt[nxt >= 0]
    draft = drafter.draft_vocab_size
    rows = torch.bincount(prev, minlength=vocab).topk(min(max_rows, vocab)).indices
    row_of = torch.full((vocab,), -1, dtype=torch.long)
    row_of[rows] = torch.arange(len(rows))
    keep = row_of[prev] >= 0
    counts = torch.zeros(len(rows), draft)
    counts.index_put_((row_of[prev[keep]], nxt[keep]), torch.ones(int(keep.sum())), accumulate=True)
    logp = (counts + smoothing).log() - (counts.sum(1, keepdim=True) + smoothing * draft).log()
    centred = logp - logp.mean(1, keepdim=True)
    u, s, v = torch.svd_lowrank(centred, q=min(rank, *centred.shape), niter=4)
    pad = rank - len(s)  # a matrix of lower rank than the head: the remaining directions start at zero
    u, v = torch.nn.functional.pad(u, (0, pad)), torch.nn.functional.pad(v, (0, pad))
    s = torch.nn.functional.pad(s, (0, pad))
    with torch.no_grad():
        head.markov_w1.weight.zero_()
        head.markov_w1.weight[rows] = (u * s.sqrt()).to(head.markov_w1.weight.dtype)
        head.markov_w2.weight.copy_(v * s.sqrt())
    return float(s.pow(2).sum() / centred.pow(2).sum())


def anchor_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The anchors of a batch depend only on (seed, epoch, batch index): a resumed run and any number of DDP
    processes draw exactly the anchors a single uninterrupted process would."""
    return torch.Generator().manual_seed(hash_id(f"anchors:{seed}:{epoch}:{batch}"))


# ---- one step -----------------------------------------------------------------------------------------------------
@dataclass
class BlockPlan:
    anchors: torch.Tensor  # [B, A]
    supervised: torch.Tensor  # [B, A, γ] bool
    weights: torch.Tensor  # [B, A, γ] position decay on supervised positions, 0 elsewhere


def plan_blocks(batch: TargetBatch, cfg: TrainConfig, generator, drafter=None) -> BlockPlan:
    """Anchors are drawn on the CPU (one generator, reproducible anywhere) and moved to the batch's device. With
    --rollout-anchors, `drafter` first finds the anchors greedy decoding would visit: where it starts its rounds,
    just after a rejected draft, is where real decoding spends them, and uniform anchors under-sample those."""
    mask = batch.loss_mask.cpu()
    visited = None
    if cfg.rollout_anchors > 0:
        with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            runs = leading_runs(drafter, batch.features, batch.input_ids, batch.loss_mask)
        visited = visited_anchors(runs, mask, cfg.block_size)
    anchors, valid = sample_anchors(mask, cfg.num_anchors, generator, visited, cfg.rollout_anchors)
    supervised = block_supervision(mask, anchors, valid, cfg.block_size)
    weights = supervised * position_weights(cfg.block_size, cfg.decay)
    dev = batch.loss_mask.device
    return BlockPlan(anchors.to(dev), supervised.to(dev), weights.to(dev))


def block_loss(model, batch: TargetBatch, plan: BlockPlan, cfg: TrainConfig, denominator=None):
    """The drafter over all blocks of the batch, then the loss on supervised positions -> (loss, metrics)."""
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        out = model(batch.features, batch.input_ids, plan.anchors)
    sel = plan.supervised.nonzero(as_tuple=True)  # (row, block, k) of every supervised position
    positions = plan.anchors[sel[0], sel[1]] + sel[2]  # q for label k comes from position anchor + k - 1
    alphas = LossWeights(cfg.ce_weight, cfg.tv_weight, cfg.conf_weight)
    need_q = alphas.tv > 0 or (alphas.conf > 0 and out.confidence_logits is not None)
    target = batch.target_dist(sel[0], positions) if need_q else None
    drafter = model.module if hasattr(model, "module") else model
    confidence = None if out.confidence_logits is None else out.confidence_logits[sel]
    return dspark_loss(
        out.logits[sel],
        out.labels[sel],
        confidence,
        plan.weights[sel],
        target,
        alphas,
        drafter.d2t,
        drafter.t2d(),
        denominator,
    )


# Blocks per held-out sequence: fixed, so runs trained with different --num-anchors are measured alike.
EVAL_ANCHORS = 256


@torch.no_grad()
def evaluate(drafter, source, examples: list[Example], cfg: TrainConfig, batch_size: int) -> dict:
    """Teacher-forced acceptance on held-out data. With greedy regenerated data, a block's greedy τ is 1 + its
    leading run of draft argmax == label, exactly what the engine would accept at that anchor: at sampled anchors
    (tau_greedy), and along the rounds greedy decoding of the held-out prompts takes (tau_rounds)."""
    drafter.eval()
    gamma = cfg.block_size
    cfg = replace(cfg, num_anchors=EVAL_ANCHORS, rollout_anchors=0.0)
    runs, blocks, accepted_pos, reached_pos = 0.0, 0, torch.zeros(gamma), torch.zeros(gamma)
    rounds, round_tokens = 0, 0
    by_source: dict[str, list[float]] = {}  # source -> [accepted drafts, blocks]
    g = torch.Generator().manual_seed(1234)
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        batch = source(chunk)
        plan = plan_blocks(batch, cfg, g)
        full = plan.supervised.all(-1)
        with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            out = drafter(batch.features, batch.input_ids, plan.anchors)
        guess = out.logits.argmax(-1)
        guess = guess if drafter.d2t is None else drafter.d2t[guess]
        match = (guess == out.labels)[full]
        lead = match.long().cumprod(-1)
        runs += float(lead.sum())
        blocks += match.shape[0]
        for row, accepted in zip(full.nonzero()[:, 0].tolist(), lead.sum(-1).tolist()):
            tally = by_source.setdefault(chunk[row].source or "other", [0.0, 0])
            tally[0] += accepted
            tally[1] += 1
        reached = torch.cat([torch.ones_like(lead[:, :1]), lead[:, :-1]], dim=1)
        accepted_pos += lead.sum(0).float().cpu()
        reached_pos += reached.sum(0).float().cpu()
        with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            every = leading_runs(drafter, batch.features, batch.input_ids, batch.loss_mask)
        for walk in rounds_by_row(every, batch.loss_mask, gamma):
            rounds += len(walk)
            round_tokens += sum(accepted + 1 for _, _, accepted in walk)
    drafter.train()
    if not blocks:
        return {}
    return {
        "tau_greedy": round(1 + runs / blocks, 4),
        "eval_blocks": blocks,
        "tau_rounds": round(round_tokens / rounds, 4) if rounds else None,
        "tau_by_source": {k: round(1 + a / n, 4) for k, (a, n) in sorted(by_source.items())},
        "accept_by_position": [round(float(a / r), 4) if r else None for a, r in zip(accepted_pos, reached_pos)],
    }


def decode_eval_prompts(target, cfg: TrainConfig) -> dict[str, list[list[int]]]:
    """The fixed slice the real-decoding evaluation decodes: the first prompts of each evaluation set, as token ids."""
    from dspark.assets import eval_prompts

    if cfg.decode_eval_every <= 0:
        return {}
    return {
        Path(name).stem: [target.encode_chat(p) for p in eval_prompts(name, cfg.decode_eval_prompts)]
        for name in cfg.decode_eval_sets
    }


def decode_eval(drafter, target, prompts: dict[str, list[list[int]]], max_new_tokens: int) -> dict:
    """τ of real greedy speculative decoding at a fixed γ on each set: what users get, not the teacher-forced proxy
    (the drafter reads the features of its own accepted tokens, and drafts past the first miss are wasted)."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policy import FixedLength
    from dspark.decoding.stats import SpecStats

    engine = SpeculativeEngine(target, drafter, FixedLength())
    taus, merged = {}, SpecStats(drafter.block_size)
    with torch.no_grad():
        for name, ids in prompts.items():
            stats = SpecStats(drafter.block_size)
            for result in engine.generate(ids, max_new_tokens):
                stats = stats.merge(result.stats)
            taus[name] = round(stats.tau, 3)
            merged = merged.merge(stats)
    drafter.train()
    return {
        "decode_tau": taus,
        "decode_tau_all": round(merged.tau, 3),
        "decode_accept_1": round(merged.accept_by_position()[0] or 0.0, 4),
    }


# ---- checkpoints --------------------------------------------------------------------------------------------------
def save_checkpoint(
    path: Path, drafter, optimizer, state: dict, target_identity: dict, cfg: TrainConfig, ancestors: list[dict]
) -> None:
    """Drafter (loadable by `dspark generate --drafter`) + optimizer + loop state + the legs it was continued from,
    swapped in atomically."""
    opt = optimizer.state_dict()
    tensors = {f"state.{i}.{k}": v.detach().cpu().contiguous() for i, s in opt["state"].items() for k, v in s.items()}
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    meta = {
        "param_groups": opt["param_groups"],
        "loop": state,
        "python_rng": [version, list(internal), gauss],
        "train_config": asdict(cfg),
    }
    with atomic_dir(path) as tmp:
        drafter.save(
            tmp / "drafter", target_identity, extra={"training": asdict(cfg), "progress": state, "lineage": ancestors}
        )
        for name in ("config.json", "model.safetensors"):  # the checkpoint folder itself loads as a drafter
            os.link(tmp / "drafter" / name, tmp / name)
        save_file(tensors, str(tmp / "trainer_state.safetensors"))
        (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=1))


def load_checkpoint(path: Path, drafter, optimizer) -> tuple[dict, dict]:
    """Everything save_checkpoint wrote, back in place; returns the loop state and the run's configuration as saved.
    The trainer state is plain JSON and tensors: nothing in it is ever evaluated or unpickled."""
    try:
        drafter.load_state_dict(load_file(str(path / "model.safetensors")))
        meta = json.loads((path / "trainer_state.json").read_text())
        tensors = load_file(str(path / "trainer_state.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise DSparkError(f"{path} is damaged and cannot be resumed ({e}); restart the run without --resume") from e
    check_trainer_state(meta, optimizer, path / "trainer_state.json")
    state = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, idx, name = key.split(".", 2)
            if not idx.isdigit() or int(idx) >= sum(len(g["params"]) for g in meta["param_groups"]):
                raise DSparkError(
                    f"{path}/trainer_state.safetensors: optimizer state for parameter {idx}, which "
                    "this drafter does not have; the checkpoint is damaged (restart without --resume)"
                )
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    random.setstate(python_rng_state(meta.get("python_rng"), path))
    return meta["loop"], meta["train_config"]


def check_trainer_state(meta, optimizer, where: Path) -> None:
    """Every field the loop and the optimizer read, checked against this run before anything is loaded."""

    def damaged(what: str):
        return DSparkError(f"{where}: {what}; the checkpoint is damaged or edited (restart the run without --resume)")

    if not isinstance(meta, dict) or not isinstance(meta.get("loop"), dict):
        raise damaged("it holds no loop state")
    loop = meta["loop"]
    for key in ("step", "epoch", "batch", "tokens"):
        if type(loop.get(key)) is not int or loop[key] < 0:
            raise damaged(f"loop.{key} must be a non-negative integer, got {loop.get(key)!r}")
    for key in ("seconds", "core_seconds"):
        value = loop.get(key, 0.0)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise damaged(f"loop.{key} must be a non-negative number, got {value!r}")
    if not isinstance(meta.get("train_config"), dict):
        raise damaged("train_config is missing")
    groups, mine = meta.get("param_groups"), optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(mine):
        raise damaged(
            f"it has {len(groups) if isinstance(groups, list) else 'no'} parameter groups, this drafter {len(mine)}"
        )
    for i, (saved, ours) in enumerate(zip(groups, mine)):
        if not isinstance(saved, dict) or saved.get("params") != ours["params"]:
            raise damaged(f"parameter group {i} does not hold this drafter's parameters")
        for key in ("lr", "weight_decay", "lr_scale", "eps"):
            value = saved.get(key, ours.get(key, 0.0))
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise damaged(f"parameter group {i}: {key} must be a non-negative number, got {value!r}")
        betas = saved.get("betas")
        if not (
            isinstance(betas, list) and len(betas) == 2 and all(type(b) in (int, float) and 0 <= b < 1 for b in betas)
        ):
            raise damaged(f"parameter group {i}: betas must be two numbers in [0, 1), got {betas!r}")


def keep_metrics_up_to(path: Path, step: int) -> None:
    """A resumed run replays the steps after its checkpoint: drop their lines (and a torn last line) first."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def python_rng_state(data, path) -> tuple:
    """Python's random state from its JSON form [version, [625 ints], gauss-or-null], checked field by field."""
    ok = (
        isinstance(data, list)
        and len(data) == 3
        and type(data[0]) is int
        and isinstance(data[1], list)
        and len(data[1]) == 625
        and all(type(x) is int for x in data[1])
        and (data[2] is None or isinstance(data[2], float))
    )
    if not ok:
        raise DSparkError(
            f"{path}/trainer_state.json: python_rng is not a random-generator state; the checkpoint "
            "is damaged or was written by an older dspark (restart the run without --resume)"
        )
    return data[0], tuple(data[1]), data[2]


def device_name(device: torch.device) -> str:
    """ "cuda: <GPU>" or "cpu: <processor>", so each leg of a drafter's lineage says where its hours were spent."""
    from dspark.autotune import cpu_name

    return f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else f"cpu: {cpu_name()}"


def param_groups(drafter, cfg: TrainConfig) -> list[dict]:
    """AdamW groups. Weight decay pulls matrices toward zero; norms (toward zero = off) and biases get none. With
    --copied-lr-scale, the layers copied from the target (already good features) move at a scaled rate; layers added
    by --add-draft-layers start as identities and learn at the full rate."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    copied_layers = [f"layers.{i}." for i in range(len(drafter.layers) - cfg.add_draft_layers)]

    def copied(name):  # one group for all when the scale is 1, as checkpoints from before the flag have
        return cfg.copied_lr_scale != 1.0 and name.startswith(("norm.", *copied_layers))

    groups = []
    for scale, members in (
        (1.0, [(n, p) for n, p in named if not copied(n)]),
        (cfg.copied_lr_scale, [(n, p) for n, p in named if copied(n)]),
    ):
        for decay, params in (
            (cfg.weight_decay, [p for _, p in members if p.ndim >= 2]),
            (0.0, [p for _, p in members if p.ndim < 2]),
        ):
            if params:
                groups.append({"params": params, "weight_decay": decay, "lr_scale": scale})
    return groups


FIT_AFTER_STEPS = 10  # steps timed before --max-minutes first sets the schedule's length; it is set again after 20,
# 40, 80 ... steps, each time from the steps since the last fit: on an H200 the first 20 steps ran 2.5x slower than the
# rest (allocations, kernel choices), and a fit from them alone left 60 % of a 5-minute lease unused.


def fit_to_minutes(total: int, step: int, seconds_per_step: float, seconds_left: float, device: torch.device) -> int:
    """The schedule's length once the step time is known: as many more steps as fit the time left, never beyond
    `total` nor before this step; every rank gets the smallest, so all stop together."""
    fitted = torch.tensor(
        [min(total, step + max(0, int(seconds_left / seconds_per_step)))], device=device
    )  # NCCL: on the GPU
    if dist.is_initialized():
        dist.all_reduce(fitted, op=dist.ReduceOp.MIN)
    return int(fitted.item())


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warmup = max(1, int(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


# ---- the loop -----------------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, resume: bool = False, progress: bool = True) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dspark.target import Target

    rank, world, device = init_distributed(cfg.device)
    cfg = cfg.for_device(device)
    if rank == 0:
        print(
            f"dspark: target in {cfg.target_dtype}, drafter autocast to bfloat16 {'on' if cfg.bf16 else 'off'}, "
            f"{device_name(device)}"
        )
    out = Path(cfg.out)
    checkpoint = out / "checkpoint"
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)

    target = Target.load(cfg.model, dtype=cfg.target_dtype, layer_ids=cfg.target_layer_ids or None, device=device)
    cfg = replace(cfg, target_layer_ids=list(target.layer_ids))  # the caller's config stays as it was given
    train_set, held_out, record_ids = load_examples(
        target, cfg.data, cfg.max_length, cfg.holdout, cfg.allow_foreign_data
    )
    decode_prompts = decode_eval_prompts(target, cfg) if rank == 0 else {}  # read now: a bad set fails at once

    ancestors = []  # the legs this run continues (`--init-from`), kept in every checkpoint
    if cfg.init_from:
        ancestors = lineage(read_checkpoint_meta(cfg.init_from))
        drafter = load_drafter(cfg.init_from, target).float()
        drafter.config.num_anchors = cfg.num_anchors
        if drafter.config.backbone != cfg.backbone == "qwen3":
            drafter = port_to_qwen3(drafter, target)
            if rank == 0:
                print(
                    f"dspark: {cfg.init_from} has the target-family backbone; continuing it on the portable qwen3 "
                    "backbone (q/k norms start at one; --backbone family keeps the family layers)"
                )
        if cfg.add_draft_layers:
            drafter.add_layers(cfg.add_draft_layers, target.model if cfg.init_target_layers else None)
            if rank == 0:
                print(
                    f"dspark: {cfg.init_from} deepened to {len(drafter.layers)} draft layers (the new ones start as "
                    "identities)"
                )
        if cfg.draft_vocab_size and cfg.draft_vocab_size != drafter.draft_vocab_size:
            before, after = widen_draft_vocabulary(drafter, train_set, cfg.draft_vocab_size, target.vocab_size)
            if rank == 0:
                print(
                    f"dspark: draft vocabulary widened to {cfg.draft_vocab_size} tokens: it covered {before:.1%} of "
                    f"the answer tokens, now {after:.1%} (new tokens start with no Markov bias)"
                )
    else:
        drafter = new_drafter(target, cfg.drafter_config()).float()
        if cfg.init_target_layers:
            drafter.init_from_target_layers(target.model)
        if cfg.draft_vocab_size:
            d2t, coverage = draft_vocabulary(train_set, cfg.draft_vocab_size, target.vocab_size)
            drafter.set_draft_vocab(d2t)
            if rank == 0:
                print(f"dspark: draft vocabulary of {cfg.draft_vocab_size} covers {coverage:.1%} of answer tokens")
        if cfg.markov_init == "bigram" and drafter.markov_head is not None:
            if drafter.config.markov_head_type != "vanilla":
                raise DSparkError(
                    "--markov-init bigram sets B(prev) = W2·W1[prev], the vanilla head's formula; use "
                    "--markov-head-type vanilla or --markov-init zero"
                )
            explained = init_markov_from_bigrams(drafter, train_set)
            if rank == 0:
                print(
                    f"dspark: Markov head starts from the data's bigrams (rank {drafter.config.markov_rank} keeps "
                    f"{explained:.1%} of their centred log-probabilities)"
                )
    drafter.to(device).train()

    source = OnlineFeatures(target, cfg.target_topk)
    if cfg.feature_cache:
        cache = Path(cfg.feature_cache)
        if rank == 0:
            build_feature_cache(cache, target, train_set, cfg.target_topk)  # or extend it by appended examples
        barrier()
        source = CachedFeatures(cache, device)
        source.check(train_set, target.identity())

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(drafter, cfg), lr=cfg.lr, betas=(0.9, 0.95))
    ddp_devices = [device] if device.type == "cuda" else None
    # The drafter's buffers are constants, equal on every rank: no need to sync them before each forward.
    model = DDP(drafter, device_ids=ddp_devices, forward_sync_buffers=False) if world > 1 else drafter

    steps_per_epoch = max(1, len(epoch_batches(train_set, cfg.batch_size, 0, cfg.seed)) // (world * cfg.grad_accum))
    total = cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.epochs * steps_per_epoch))
    loop = {"step": 0, "epoch": 0, "batch": 0, "seconds": 0.0, "tokens": 0}
    if resume:
        recover_dir(checkpoint)
        if not (checkpoint / "trainer_state.json").exists():
            raise DSparkError(f"nothing to resume: {checkpoint} has no trainer state")
        loop, saved = load_checkpoint(checkpoint, drafter, optimizer)
        if loop["step"] >= total:
            raise DSparkError(
                f"the checkpoint in {checkpoint} is at step {loop['step']}, {'the end' if loop['step'] == total else 'past the end'} "
                f"of a schedule of {total} steps: nothing to train. Pass --max-steps above "
                f"{loop['step']} to go on"
            )
        # The lineage as at the run's start, even if --init-from has been overwritten since; checkpoints written
        # before the lineage existed keep the one just read from --init-from.
        ancestors = read_checkpoint_meta(checkpoint).get("lineage", ancestors)
        appended = continue_on_data(loop, record_ids, len(train_set), saved.get("data"))
        if appended > 0:
            loop["epoch"], loop["batch"] = loop["epoch"] + 1, 0
            if rank == 0:
                print(
                    f"dspark: {appended} training examples appended since the checkpoint; they join from epoch "
                    f"{loop['epoch']} on"
                )
    loop["data"] = data_seen(record_ids, len(train_set))
    loop["device"] = device_name(device)
    cores = world * (1 if device.type == "cuda" else torch.get_num_threads())  # GPUs, or CPU threads
    loop.setdefault("core_seconds", loop["seconds"] * cores)

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)  # only now: a run that fails on its inputs leaves no folder behind
    if rank == 0 and resume:
        keep_metrics_up_to(out / "metrics.jsonl", loop["step"])
    metrics_file = (out / "metrics.jsonl").open("a") if rank == 0 else None
    bar = tqdm(
        total=total,
        initial=loop["step"],
        desc="train",
        unit="step",
        disable=not progress or rank > 0,
        dynamic_ncols=True,
    )
    start = time.perf_counter() - loop["seconds"]
    batches = epoch_batches(train_set, cfg.batch_size, loop["epoch"], cfg.seed)
    last = {}
    fit_from = loop["step"]  # --max-minutes counts this invocation's steps: not loading, evaluations, checkpoints
    asked_steps = total  # a refit may lengthen the schedule again, never beyond this
    step_seconds = 0.0
    fitted_at = None  # (steps, step seconds) of this invocation when the step time was last measured from
    while loop["step"] < total:
        step_started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        micro = []
        for _ in range(cfg.grad_accum):
            if loop["batch"] + world > len(batches):
                loop["epoch"] += 1
                loop["batch"] = 0
                batches = epoch_batches(train_set, cfg.batch_size, loop["epoch"], cfg.seed)
            index = loop["batch"] + rank
            micro.append(([train_set[i] for i in batches[index]], anchor_generator(cfg.seed, loop["epoch"], index)))
            loop["batch"] += world
        # Each micro-batch's loss is a weighted mean over every supervised position of the whole step, all ranks.
        prepared = [source(m) for m, _ in micro]
        plans = [plan_blocks(b, cfg, g, drafter) for b, (_, g) in zip(prepared, micro)]
        local = torch.stack(
            [
                sum(p.weights.sum() for p in plans).float().cpu(),
                torch.tensor(float(sum(int(b.loss_mask.sum()) for b in prepared))),
            ]
        )
        denominator, step_tokens = all_sum(local).tolist()
        step_metrics = {}
        for i, (batch, plan) in enumerate(zip(prepared, plans)):
            # DDP all-reduces gradients on the last micro-batch only; the others accumulate locally.
            sync = i == len(prepared) - 1 or world == 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss, metrics = block_loss(model, batch, plan, cfg, torch.tensor(denominator, device=device))
                (loss * world).backward()  # DDP averages gradients over ranks; the denominator is already global
            for k, v in metrics.items():
                step_metrics[k] = step_metrics.get(k, 0.0) + v
        loop["tokens"] += int(step_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        lr = lr_at(loop["step"], total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        optimizer.step()
        loop["step"] += 1
        if loop["step"] % 10 == 0:
            return_freed_memory()
        step_seconds += time.perf_counter() - step_started
        done_here = loop["step"] - fit_from
        fitted_at = fitted_at or (
            done_here,
            step_seconds,
        )  # the first step also warms up (allocations, kernels): not timed
        refit = done_here % FIT_AFTER_STEPS == 0 and (done_here // FIT_AFTER_STEPS).bit_count() == 1  # 10, 20, 40 ...
        if cfg.max_minutes and refit:
            per_step = (step_seconds - fitted_at[1]) / (done_here - fitted_at[0])
            fitted_at = (done_here, step_seconds)
            total = fit_to_minutes(asked_steps, loop["step"], per_step, cfg.max_minutes * 60 - step_seconds, device)
            cfg = replace(cfg, max_steps=total)  # saved with the checkpoints, so a plain --resume keeps the schedule
            bar.total = total
            if rank == 0:
                bar.write(f"dspark: {per_step:.2f} s a step: {total} steps fit --max-minutes {cfg.max_minutes:g}")
        elapsed = time.perf_counter() - start
        loop["core_seconds"] += (elapsed - loop["seconds"]) * cores
        loop["seconds"] = elapsed
        last = {
            "step": loop["step"],
            "epoch": loop["epoch"],
            "lr": lr,
            "grad_norm": float(grad_norm),
            "seconds": round(loop["seconds"], 1),
            "tokens": loop["tokens"],
            **step_metrics,
        }
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in step_metrics.items()})
        due_eval = loop["step"] % cfg.eval_every == 0 or loop["step"] == total
        if due_eval and rank == 0 and held_out:
            last.update(evaluate(drafter, OnlineFeatures(target, 0), spread_slice(held_out, 64), cfg, cfg.batch_size))
            bar.write(
                json.dumps(
                    {
                        k: last[k]
                        for k in ("step", "tau_greedy", "tau_rounds", "accept_by_position", "tau_by_source")
                        if k in last
                    }
                )
            )
        due_decode = cfg.decode_eval_every > 0 and (loop["step"] % cfg.decode_eval_every == 0 or loop["step"] == total)
        if due_decode and rank == 0:
            last.update(decode_eval(drafter, target, decode_prompts, cfg.decode_eval_tokens))
            bar.write(json.dumps({k: last[k] for k in ("step", "decode_tau", "decode_tau_all")}))
        if rank == 0:
            metrics_file.write(json.dumps(last) + "\n")
            metrics_file.flush()
        if loop["step"] % cfg.save_every == 0 or loop["step"] == total:
            if rank == 0:
                save_checkpoint(checkpoint, drafter, optimizer, loop, target.identity(), cfg, ancestors)
            barrier()
    bar.close()
    if metrics_file:
        metrics_file.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return last
