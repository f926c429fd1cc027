"""Drafters in other runtimes' formats (docs/formats.md): export to speculators (vLLM), DeepSpec and GGUF (llama.cpp),
and import of speculators and DeepSpec DSpark folders into a dspark checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

EXPORT_FORMATS = ("dspark", "speculators", "deepspec", "gguf")

# Files that travel with a drafter's weights: its calibration (the scheduler's temperatures) and its model card.
# The calibration means something only to dspark; the model card travels everywhere.
COMPANIONS = {"dspark": ("calibration.json", "MODEL_CARD.md")}
DEFAULT_COMPANIONS = ("MODEL_CARD.md",)


def export_drafter(
    source: Path, out: Path, fmt: str, drafter, target, dtype, meta: dict, target_gguf: Path | None = None
) -> list[str]:
    """Write `drafter` (loaded from the checkpoint `source`) into the folder `out` in format `fmt`, atomically and
    with a manifest of what it wrote. Returns the companion files carried from `source`."""
    from dspark.fsutil import atomic_dir

    with atomic_dir(out, manifest=True) as tmp:
        if fmt == "dspark":
            extra = {k: v for k, v in meta.items() if k in ("training", "progress", "lineage")}
            drafter.write_files(tmp, target.identity(), extra=extra, dtype=dtype)
        else:
            export_foreign(drafter, target, tmp, fmt, dtype, target_gguf)
        carried = [name for name in COMPANIONS.get(fmt, DEFAULT_COMPANIONS) if (source / name).is_file()]
        for name in carried:
            shutil.copy2(source / name, tmp / name)
    return carried


def import_drafter(source: Path, out: Path, target) -> str:
    """Read a speculators or DeepSpec drafter folder and write it as a dspark checkpoint in `out` (atomically, with a
    manifest). Returns the format it was read from."""
    from dspark.fsutil import atomic_dir

    drafter = import_foreign(source, target)  # refuses a folder of neither format, saying so
    fmt = detect(source) or "foreign"
    with atomic_dir(out, manifest=True) as tmp:
        drafter.write_files(tmp, target.identity(), extra={"imported_from": {"format": fmt, "path": str(source)}})
    return fmt


def export_foreign(drafter, target, out: Path, fmt: str, dtype, target_gguf: Path | None = None) -> None:
    """Write the drafter into the folder `out` (already created, empty) in a foreign format."""
    from dspark.formats.hf import EXPORTERS

    if fmt == "gguf":
        from dspark.formats.gguf import export_gguf

        export_gguf(drafter, target, out, dtype, target_gguf)
    else:
        EXPORTERS[fmt](drafter, target, out, dtype)


def import_foreign(path: Path, target):
    """A DSparkDrafter for `target` from a speculators or DeepSpec folder (weights checked against the config)."""
    from dspark.drafter.registry import drafter_class, load_checked_state
    from dspark.formats.hf import read_foreign

    config, state = read_foreign(Path(path), target)
    drafter = drafter_class(config.architecture)(
        config, target.config, target.embed_tokens.weight, target.lm_head.weight
    )
    load_checked_state(drafter, state, f"{path}: the weights")
    return drafter.to(target.dtype).eval()


def detect(path: Path) -> str | None:
    """'speculators', 'deepspec' or None: the foreign format of a drafter folder."""
    from dspark.formats.hf import detect as detect_hf

    return detect_hf(Path(path))
