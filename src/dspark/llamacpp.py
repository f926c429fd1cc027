"""llama.cpp through its Python bindings (llama-cpp-python), an optional dependency: one place that imports it and
loads a GGUF the way every caller here needs."""

from __future__ import annotations

from pathlib import Path

from dspark.errors import DSparkError


def import_llama_cpp():
    """The llama_cpp module, or None when it is not installed or its library cannot be loaded."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError):  # OSError/FileNotFoundError: bindings without their libllama
        return None
    return llama_cpp


def require_llama_cpp():
    llama_cpp = import_llama_cpp()
    if llama_cpp is None:
        raise DSparkError(
            "this needs llama-cpp-python with its library: `pip install llama-cpp-python`, or the "
            "bindings over a llama.cpp you built, with LLAMA_CPP_LIB_PATH set (docs/formats.md)"
        )
    return llama_cpp


def load_gguf(path: Path, threads: int, **kwargs):
    """llama_cpp.Llama on a GGUF file. Weight repacking for AMX is turned off: it faults on machines that report AMX
    but do not grant its tile state."""
    llama_cpp = require_llama_cpp()
    if not Path(path).is_file():
        raise DSparkError(f"{path} does not exist; pass the target's GGUF file")
    default = llama_cpp.llama_model_default_params

    def no_repack():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = no_repack
    try:
        return llama_cpp.Llama(str(path), n_threads=threads, verbose=False, **kwargs)
    finally:
        llama_cpp.llama.llama_cpp.llama_model_default_params = default


def prompt_lookup_draft(num_pred_tokens: int = 10):
    """llama-cpp-python's own speculation: drafts looked up in the prompt and output so far (pass as `draft_model`)."""
    require_llama_cpp()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)
