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
    from dspark.drafter.registry import drafter_class
    from dspark.errors import DSparkError
    from dspark.formats.hf import read_foreign

    config, state = read_foreign(Path(path), target)
    drafter = drafter_class(config.architecture)(config, target.config, target.embed_tokens.weight,
                                                 target.lm_head.weight)
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise DSparkError(f"{path}: the weights do not match its config.json (missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]}, wrong shapes {sorted(wrong)[:4]})")
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return drafter.to(target.dtype).eval()


def detect(path: Path) -> str | None:
    """'speculators', 'deepspec' or None: the foreign format of a drafter folder."""
    from dspark.formats.hf import detect as detect_hf

    return detect_hf(Path(path))
