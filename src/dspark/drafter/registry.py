"""Drafter architectures by name, and the two ways to get one: fresh for a target, or loaded from a checkpoint.

Loading checks everything a hand-edited or damaged folder can get wrong (JSON, field types, format version, the
target it was trained for, the weights file and its shapes) and says which file to fix; it never unpickles."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from dspark.drafter.config import DSparkConfig
from dspark.drafter.eagle import EagleDrafter
from dspark.drafter.model import (
    CHECKPOINT_FORMAT,
    FORMAT_VERSION,
    WEIGHT_SHAPING_FIELDS,
    DSparkDrafter,
    only_portable_extras,
)
from dspark.errors import DSparkError
from dspark.fsutil import recover_dir

ARCHITECTURES = {"dspark": DSparkDrafter, "eagle3": EagleDrafter}


def drafter_class(architecture: str) -> type[DSparkDrafter]:
    if architecture not in ARCHITECTURES:
        raise DSparkError(f"unknown drafter architecture '{architecture}'; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[architecture]


def new_drafter(target, config: DSparkConfig | None = None) -> DSparkDrafter:
    """A fresh drafter for a Target; unset layer ids and mask token come from the target (the config is not
    modified: the drafter holds a completed copy)."""
    config = DSparkConfig.from_dict((config or DSparkConfig()).to_dict())
    if not config.target_layer_ids:
        config.target_layer_ids = list(target.layer_ids)
    if config.mask_token_id < 0:
        config.mask_token_id = target.unused_token_id()
    return drafter_class(config.architecture)(config, target.config, target.embed_tokens.weight, target.lm_head.weight)


def port_to_qwen3(drafter: DSparkDrafter, target) -> DSparkDrafter:
    """A `family` drafter moved onto the portable Qwen3-style backbone, as a warm start for training (not an exact
    copy: the new q/k norms start at one, so attention scores change until training adapts them). Every other
    weight, the draft vocabulary included, carries over."""
    if drafter.config.backbone == "qwen3":
        return drafter
    config = DSparkConfig.from_dict({**drafter.config.to_dict(), "backbone": "qwen3"})
    ported = new_drafter(target, config).to(next(drafter.parameters()).dtype)
    missing, unexpected = ported.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or not only_portable_extras(missing):
        raise DSparkError(
            f"this drafter's layers do not fit the qwen3 backbone (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}); train a new drafter with --backbone qwen3"
        )
    return ported


def read_checkpoint_meta(path: str | Path) -> dict:
    path = Path(path)
    recover_dir(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise DSparkError(f"{path} is not a drafter checkpoint (it needs config.json and model.safetensors)")
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DSparkError(f"{path}/config.json is not valid JSON ({e}); restore it from the run that wrote it") from e
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DSparkError(f"{path}/config.json is not a dspark drafter config (format={got!r})")
    version = meta.get("format_version")
    if version not in range(1, FORMAT_VERSION + 1):
        raise DSparkError(
            f"{path}/config.json has format_version {version!r}; this dspark reads versions 1 to "
            f"{FORMAT_VERSION} (upgrade dspark for newer checkpoints)"
        )
    if not isinstance(meta.get("drafter"), dict) or not isinstance(meta.get("target"), dict):
        raise DSparkError(f"{path}/config.json needs 'drafter' and 'target' objects")
    return meta


def lineage(meta: dict) -> list[dict]:
    """Every training leg that made a checkpoint, oldest first: the legs it was continued from (`--init-from`, kept in
    its config as "lineage") and then its own run ("training" and "progress"). A warm start on a new machine thus keeps
    the whole history, so the drafter's compute adds up across sessions even where run folders do not survive."""
    legs = [dict(leg) for leg in meta.get("lineage") or [] if isinstance(leg, dict)]
    run, progress = meta.get("training"), meta.get("progress")
    if isinstance(run, dict) and isinstance(progress, dict):
        legs.append(
            {
                "run": run.get("out"),
                "data": run.get("data"),
                "steps": progress.get("step"),
                "tokens": progress.get("tokens"),
                "seconds": progress.get("seconds"),
                "core_seconds": progress.get("core_seconds"),
                "device": progress.get("device"),
            }
        )
    return legs


def training_totals(meta: dict) -> dict:
    """What a checkpoint's training cost in all: legs, steps, training tokens, CPU core-hours and GPU-hours (a total
    is None where one of its legs did not record it), and its last leg."""
    legs = lineage(meta)
    on_gpu = [str(leg.get("device") or "").startswith("cuda") for leg in legs]

    def hours(gpu: bool):
        spent = [leg.get("core_seconds") for leg, g in zip(legs, on_gpu) if g == gpu]
        return None if None in spent else round(sum(spent) / 3600, 2)

    return {
        "legs": len(legs),
        "steps": sum(leg.get("steps") or 0 for leg in legs),
        "tokens": sum(leg.get("tokens") or 0 for leg in legs),
        "core_hours": hours(False),
        "gpu_hours": hours(True),
        "last_leg": legs[-1] if legs else None,
    }


def load_drafter(path: str | Path, target) -> DSparkDrafter:
    path = Path(path)
    meta = read_checkpoint_meta(path)
    want, have = meta["target"].get("fingerprint"), target.fingerprint
    if want != have:
        raise DSparkError(
            f"the drafter in {path} was trained for target '{meta['target'].get('name_or_path')}' "
            f"(fingerprint {want}), but the loaded target '{target.name}' has fingerprint {have}. "
            "Load the target it was trained for, or train a drafter for this one (`dspark train`)."
        )
    config = DSparkConfig.from_dict(meta["drafter"], where=f"{path}/config.json")
    drafter = drafter_class(config.architecture)(
        config, target.config, target.embed_tokens.weight, target.lm_head.weight
    )
    weights = path / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            echo = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors reports damage with its own exception types
        raise DSparkError(f"{weights} is damaged or truncated ({e}); copy it again or re-export the checkpoint") from e
    for field in WEIGHT_SHAPING_FIELDS:
        saved = echo.get(f"dspark.{field}")
        if saved is not None and json.loads(saved) != getattr(config, field):
            raise DSparkError(
                f"{path}: config.json says {field}={getattr(config, field)!r} but the weights were "
                f"saved with {field}={json.loads(saved)!r}; restore the config.json that came with them"
            )
    load_checked_state(drafter, state, f"{path}: model.safetensors")
    # The target's product form: FBGEMM's float16 where the machine's tuning chose it for the LM head; else packed where
    # the target is, or quantized (it has no float form of its own, and its drafter runs in bfloat16, where packed
    # products proposed faster: γ = 7 at one row, 2-core EPYC with AVX-512-BF16, 3.5 against 4.1 ms).
    if target.head.form_name == "float16":
        form = "float16"
    else:
        form = "packed" if target.decoder.packed or target.quantized else "plain"
    return drafter.to(target.dtype).use_product_form(form)


def load_checked_state(drafter, state: dict, where: str) -> None:
    """Load weights that must match the drafter's config tensor for tensor, naming what does not."""
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k} {tuple(state[k].shape)} (config wants {tuple(expected[k].shape)})"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    if missing or unexpected or wrong:
        raise DSparkError(
            f"{where} does not match config.json (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, wrong shapes {wrong[:4]}); the config was edited or the files come "
            "from different checkpoints"
        )
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


NGRAM_PREFIX = "ngram:"  # --drafter ngram:DATA builds the n-gram proposer from regenerated data
SUFFIX_SPEC = "suffix"  # --drafter suffix: suffix decoding alone, no model; suffix:PATH fills its tree from PATH
SUFFIX_PREFIX = "suffix:"
NO_SUFFIX_PREFIX = "no-suffix:"  # --drafter no-suffix:PATH: the checkpoint's drafter alone, as --no-suffix


def checkpoint_of(spec) -> Path | None:
    """The drafter checkpoint folder a --drafter spec loads: None for the n-gram proposer and suffix decoding alone."""
    spec = str(spec or "")
    if not spec or spec == SUFFIX_SPEC or spec.startswith((NGRAM_PREFIX, SUFFIX_PREFIX)):
        return None
    return Path(spec.removeprefix(NO_SUFFIX_PREFIX))


def answer_index_of(spec) -> Path | None:
    """The answer index a `suffix:PATH` spec fills the global tree from (PATH: an index, or a folder holding one)."""
    from dspark.drafter.suffix import ANSWER_INDEX

    spec = str(spec)
    if not spec.startswith(SUFFIX_PREFIX):
        return None
    path = Path(spec.removeprefix(SUFFIX_PREFIX))
    return path / ANSWER_INDEX if path.is_dir() else path


def drafter_beside(index: Path) -> dict | None:
    """The checkpoint config of the drafter whose folder holds this answer index (None for an index elsewhere)."""
    return read_checkpoint_meta(index.parent) if (index.parent / "config.json").is_file() else None


def load_proposer(spec: str | Path, target, suffix: bool | None = None, isolate: bool = False):
    """A drafter checkpoint folder, `ngram:DATA` for the n-gram proposer built from a regenerated data file, `suffix`
    for suffix decoding alone (`suffix:PATH`: its global tree filled from PATH's answer index), or
    `no-suffix:CHECKPOINT` for a drafter without suffix decoding. A checkpoint drafts beside suffix decoding
    (drafter.hybrid) where `suffix` says so, or by default (None) where it ships an answer index and the suffix trees
    are installed; the global tree is filled from that index. isolate: served answers never join the global tree."""
    from dspark.drafter.suffix import (
        ANSWER_INDEX,
        AnswerIndex,
        SuffixProposer,
        read_answer_index,
        suffix_trees_available,
    )

    if str(spec).startswith(NGRAM_PREFIX):
        from dspark.drafter.ngram import NgramProposer

        return NgramProposer.from_data(str(spec)[len(NGRAM_PREFIX) :], target)
    checkpoint = checkpoint_of(spec)
    if checkpoint is None:
        index = answer_index_of(spec)
        answers, calibration = read_answer_index(index) if index is not None else AnswerIndex([], None)
        beside = drafter_beside(index) if index is not None else None
        block = beside["drafter"].get("block_size", 7) if beside else 7  # as many drafts as the drafter's rounds
        if calibration is not None:
            block = calibration.shape[1]
        return SuffixProposer(target.vocab_size, block, answers, isolate=isolate, calibration=calibration)
    if str(spec).startswith(NO_SUFFIX_PREFIX):
        suffix = False
    drafter = load_drafter(checkpoint, target)
    index = checkpoint / ANSWER_INDEX
    if suffix is None:
        suffix = index.is_file() and suffix_trees_available()
    if not suffix:
        return drafter
    from dspark.drafter.hybrid import MIN_MATCH, HybridProposer

    answers, calibration = read_answer_index(index) if index.is_file() else AnswerIndex([], None)
    tree = SuffixProposer(
        target.vocab_size, drafter.block_size, answers, isolate=isolate, min_match=MIN_MATCH, calibration=calibration
    )
    return HybridProposer(drafter, tree)


def model_drafter(proposer):
    """The model a proposer runs (the hybrid's drafter; the proposer itself otherwise): what a cost table times."""
    return getattr(proposer, "drafter", proposer)
