"""Drafters in other runtimes' formats (docs/formats.md): export to speculators (vLLM), DeepSpec and GGUF (llama.cpp),
and import of speculators and DeepSpec DSpark folders into a dspark checkpoint."""

from __future__ import annotations

from pathlib import Path

EXPORT_FORMATS = ("dspark", "speculators", "deepspec", "gguf")


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
    drafter = drafter_class(config.architecture)(config, target.config, target.embed_tokens.weight,
                                                 target.lm_head.weight)
    load_checked_state(drafter, state, f"{path}: the weights")
    return drafter.to(target.dtype).eval()


def detect(path: Path) -> str | None:
    """'speculators', 'deepspec' or None: the foreign format of a drafter folder."""
    from dspark.formats.hf import detect as detect_hf

    return detect_hf(Path(path))
