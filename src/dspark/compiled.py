"""A target whose decode forwards of one request run as one graph compiled by inductor (LeanDecoder.compile)."""

from __future__ import annotations

import os

import torch

from dspark import models
from dspark.kvcache import GRANULE
from dspark.target import Target


def compile_target(target: Target) -> Target:
    """Compile `target`'s one-row decode step: a one-token step without the eager framework's ~6,000 small calls.
    Compiles now, both graphs the decoding loop needs (a block read by every query, and one that crosses into the
    next 64 keys): minutes the first time on a machine, then about half a minute (the graphs are traced again;
    inductor's kernels are kept in the dspark cache). Plain and speculative decoding of the compiled target agree
    token for token; its logits differ from the eager target's in the last bits, and its LM head is the rescored one
    (LMHead.use_rescored), or the float16 head where the machine's tuning chose it (2-core AVX2-only EPYC, 1 / 8
    rows: 2.9 / 5.8 against the rescored head's 3.3 / 11 ms)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Inductor's default lives in the system's temporary folder; a folder the user chose is kept.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(models.cache_dir() / "inductor")
    target.decoder.compile()
    if target.head.form_name != "float16":  # where the machine chose FBGEMM's head, it beats the rescored one too
        target.head.use_rescored()
    cache = target.new_cache(1)
    ids = torch.zeros(1, GRANULE, dtype=torch.long, device=target.device)
    target.prefill(cache, ids[:, : GRANULE - 1])
    target.forward(cache, ids[:, :1])  # the first group's last slot: every query reads one group of keys
    cache.rollback(cache.lengths - 1)
    target.forward(cache, ids[:, :2])  # that slot and the next group's first: two groups
    return target
