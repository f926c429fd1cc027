"""Our own forward of a pre-norm decoder LM (Llama, Qwen2, Qwen3, Gemma 1/2/3) over the position-addressed KV cache.

Hugging Face loads the weights and stays the reference (the tests hold this forward to its logits and hidden
states); the forward is ours because the per-token cost of a 135M model on a CPU is mostly framework overhead:
module dispatch, masks and cache objects rebuilt per call. Here q/k/v and gate/up are fused into one matrix each
(the HF modules keep working on views of the fused weights, so nothing is stored twice), no mask is built where a
batch is not ragged and carries one token, and the LM head runs only where the caller wants logits.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from dspark.errors import DSparkError
from dspark.kvcache import GRANULE, KVCache, causal_visibility

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")


def real_positions(num_new: torch.Tensor, width: int) -> torch.Tensor | None:
    """[B, W] which positions of a forward are real (row b: its first num_new[b]); None when all are."""
    if width > 1 and bool((num_new < width).any()):
        return torch.arange(width, device=num_new.device)[None, :] < num_new[:, None]
    return None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for x [B, H, L, hd] with cos/sin [B, L, hd] (the rotate-half convention of HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as the HF Llama/Qwen modules do."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scale by (1 + weight), in float32, cast back only at the end."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def attention(q, keys, values, mask, scale: float, causal: bool = False, fold: bool | None = None) -> torch.Tensor:
    """Attention of q [B, H, W, hd] over grouped keys/values [B, Hkv, S, hd] (GQA), under a boolean mask [B, 1, W, S]
    or causally from slot 0 (`causal`, no mask). On CUDA (`fold` None: decided by the device), each group's query
    heads are folded into the query length instead of passing enable_gqa: PyTorch's fused CUDA kernels take no mask
    together with enable_gqa, and SDPA then falls back to its math kernel, which materialises every score in float32.
    The folded form is the same attention (query head h reads key head h // groups either way); a causal pass keeps
    enable_gqa, which flash attention takes when there is no mask."""
    groups = q.shape[1] // keys.shape[1]
    if fold is None:
        fold = q.is_cuda
    if groups > 1 and fold and not causal:
        folded = None if mask is None else fold_mask(mask, q.shape[0], q.shape[2], groups)
        return folded_attention(q, keys, values, folded, scale)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1
    )


def fold_mask(mask: torch.Tensor, batch: int, width: int, groups: int) -> torch.Tensor:
    """A mask [B, 1, W, S] for queries folded as `folded_attention` folds them: [B, 1, groups * W, S]."""
    return mask.expand(batch, 1, width, -1).repeat(1, 1, groups, 1)


def folded_attention(q, keys, values, folded_mask, scale: float) -> torch.Tensor:
    """Attention of q [B, H, W, hd] over keys/values [B, Hkv, S, hd] with each group's query heads folded into the
    query length (row j*W + w: head (kv, j), position w), under a mask from `fold_mask` (or None)."""
    batch, heads, width, dim = q.shape
    folded = q.reshape(batch, keys.shape[1], heads // keys.shape[1] * width, dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=folded_mask, scale=scale)
    return out.reshape(batch, heads, width, dim)  # the fused CUDA kernels may return another layout


MIN_QUERIES = 4  # per SDPA call, query heads folded in


class QueryGroup(NamedTuple):
    """Queries read with one key length: rows/cols select them (None: all), padded lists the query columns sent to
    SDPA (with the heads folded in, at least MIN_QUERIES queries), mask is their visibility as an additive mask
    [b, 1, groups * len(padded), end] folded for `folded_attention` (the same for every layer: built once per
    forward, in the form SDPA would convert a boolean mask to on every call)."""

    end: int
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    padded: torch.Tensor
    mask: torch.Tensor
    chosen: torch.Tensor | None


def plan_buckets(positions: torch.Tensor, groups: int, dtype: torch.dtype) -> list[QueryGroup]:
    """Batch-invariant attention, planned once per forward (the same for every layer): every query at position p
    reads the keys of slots 0 .. round_up(p + 1) - 1, those past p masked.

    SDPA's CPU kernel reduces a query's scores in an order set by the key length of the call (and runs another path
    for fewer than MIN_QUERIES queries: measured, 1-3 queries differ from the same queries among 4 or more), not by
    the other queries or rows in it. A 1-token step over p + 1 keys and the same query inside a verify over more
    keys can differ in the last bit, which flips near-tie tokens. Here the key length depends on the query's own
    position alone, so its output is the same alone, in any verify block and in any ragged batch. Queries are
    grouped by that length, a short group padded with copies of its last query: one group where every query reads
    the same keys (rows of one length), one per 64 positions in a prefill, one per length bucket in a batch of rows
    of several lengths. `groups`: query heads per key head; `dtype`: the queries'."""
    width = positions.shape[1]
    ends = (positions + GRANULE) // GRANULE * GRANULE  # round_up(p + 1)
    slots = torch.arange(int(ends.max()), device=positions.device)
    least = -(-MIN_QUERIES // groups)  # query columns, so that SDPA sees at least MIN_QUERIES folded queries
    planned = []
    for end in ends.unique().tolist():
        chosen = ends == end
        if bool(chosen.all()):
            rows = cols = None
            cols_all = torch.arange(width, device=positions.device)
            where, picked = positions, None
        elif bool((chosen == chosen[:1]).all()):  # the same columns in every row (a prefill): no row to gather
            rows, cols = None, chosen[0].nonzero()[:, 0]
            cols_all, where, picked = cols, positions[:, cols], None
        else:
            rows = chosen.any(1).nonzero()[:, 0]
            cols = chosen[rows].any(0).nonzero()[:, 0]
            cols_all, where, picked = cols, positions[rows][:, cols], chosen[rows[:, None], cols[None, :]]
        padded = torch.cat([cols_all, cols_all[-1:].expand(max(0, least - len(cols_all)))])
        extra = where[:, -1:].expand(-1, len(padded) - where.shape[1])
        mask = (slots[:end][None, None, :] <= torch.cat([where, extra], 1)[:, :, None])[:, None]
        mask = fold_mask(mask, mask.shape[0], len(padded), groups)
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        planned.append(QueryGroup(end, rows, cols, padded, mask, picked))
    return planned


def bucketed_attention(q, keys, values, groups: list[QueryGroup], scale: float) -> torch.Tensor:
    """Attention of q [B, H, W, hd] over a row's whole cache (keys/values [B, Hkv, capacity, hd]), planned by
    `plan_buckets`."""
    batch, heads, width, dim = q.shape
    # Query heads folded into the query length (`attention`): on a CPU, SDPA with enable_gqa took 1.7x as long
    # (a 2-core EPYC, bfloat16, 16 rows of 4 queries over 320 keys: 1.18 against 0.69 ms a layer).
    if len(groups) == 1 and groups[0].rows is None:  # the usual case: every query reads the same keys
        g = groups[0]
        qp = q if len(g.padded) == width else q[:, :, g.padded]
        out = folded_attention(qp, keys[:, :, : g.end], values[:, :, : g.end], g.mask, scale)
        return out[:, :, :width]
    out = q.new_empty(batch, width, heads, dim)
    for g in groups:
        cols = g.cols if g.cols is not None else torch.arange(width, device=q.device)
        if g.rows is None:  # every row: the caches are read in place
            part = folded_attention(q[:, :, g.padded], keys[:, :, : g.end], values[:, :, : g.end], g.mask, scale)
            out[:, cols] = part[:, :, : len(cols)].transpose(1, 2)
            continue
        rows = g.rows
        part = folded_attention(
            q[rows][:, :, g.padded], keys[rows, :, : g.end], values[rows, :, : g.end], g.mask, scale
        )
        part = part[:, :, : len(cols)].transpose(1, 2)
        grid = rows[:, None], cols[None, :]
        out[grid] = part if g.chosen is None else torch.where(g.chosen[..., None, None], part, out[grid])
    return out.transpose(1, 2)


def softcapped_attention(q, keys, values, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping, cap·tanh(scores/cap), which SDPA cannot express."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * (scale / cap)) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


class Int8Weight:
    """A weight-only int8 matrix: per-output-channel scales, products in the activations' precision."""

    error = float("inf")  # rounding moves weights of every float model (see Int4Weight.error)

    def __init__(self, weight: torch.Tensor):
        scale = weight.float().abs().amax(dim=1).clamp_min(1e-8) / 127
        self.q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(weight.dtype)


class Int4Weight:
    """A weight-only 4-bit matrix: each group of GROUP input columns of a row has its own step and minimum, 16 levels
    from min to max (llama.cpp's Q4_1 layout: weights dequantized from a Q4_1 file get their own grid back exactly),
    multiplied with bfloat16 activations by PyTorch's int4 CPU kernel. Its product of a row does not depend on the
    rows beside it (tested on the real target). `error`: the largest change rounding made to a weight, relative to
    the largest weight of its group (weights from a Q4_1 file, read in bfloat16: ~2^-8; a float model's: ~1/15)."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor):
        rows, cols = weight.shape
        groups = weight.float().view(rows, cols // self.GROUP, self.GROUP)
        low = groups.amin(-1)
        step = (groups.amax(-1) - low) / 15
        q = torch.round((groups - low[..., None]) / step.clamp_min(1e-12)[..., None]).clamp(0, 15)
        moved = (q * step[..., None] + low[..., None] - groups).abs().amax(-1)
        self.error = float((moved / groups.abs().amax(-1).clamp_min(1e-30)).max())
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(rows, cols), 8)
        # the kernel computes (q - 8) * step + zero: zero is the group's value at level 8
        self.scales_and_zeros = torch.stack([step, low + 8 * step], -1).transpose(0, 1).contiguous().bfloat16()


class RescoredHead:
    """The LM head of a target that decodes one request at a time (a compiled one): every token scored with a 4-bit
    copy of the matrix (Int4Weight: a quarter of bfloat16's bytes), then the CANDIDATES best scored again from the
    full-precision weights in float32. The greedy token is the exact argmax wherever that ranks among the 4-bit
    scores' first CANDIDATES (on 1,901 answer positions of the shipped target it ranked 6th at worst); the tail keeps
    the 4-bit scores. The 4-bit kernel's cost grows with every row, so a target that batches requests keeps its
    bfloat16 head (docs/experiments.md, "the compiled target's LM head as 4-bit candidates")."""

    CANDIDATES = 64

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
        vocab = weight.shape[0]
        self.coarse = Int4Weight(F.pad(weight, (0, 0, 0, -vocab % 16)))  # the kernel packs rows by 16

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] of hidden states [n, d]; a row's do not depend on the rows beside it."""
        scores = linear(rows.bfloat16(), self.coarse)[:, : self.dense.shape[0]].float()  # the kernel's activations
        best = scores.topk(min(self.CANDIDATES, scores.shape[-1]), dim=-1, sorted=False).indices
        exact = (self.dense[best].float() * rows.float()[:, None, :]).sum(-1)
        return scores.scatter_(1, best, exact)


def quantized_weight(weight: torch.Tensor, bits: int) -> Int8Weight | Int4Weight:
    """4 bits where the columns split into whole groups, else 8."""
    return Int4Weight(weight) if bits == 4 and weight.shape[1] % Int4Weight.GROUP == 0 else Int8Weight(weight)


class PackedWeight:
    """A bfloat16 or float32 matrix reordered once into oneDNN's blocked layout. F.linear reorders a bfloat16 weight on
    every call; on an AMX Xeon a decode step's products streamed the packed weights 1.3-1.5x faster at 1, 8 and 64
    rows (the same products up to rounding, which can move near-tie tokens). float32's F.linear runs MKL, whose
    few-row products are slow on some CPUs (2-core AVX2-only EPYC, LM head at 4 rows: MKL 32, oneDNN 14 ms).
    `dense` stays for everything else that reads the matrix."""

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)


class PackedLinear(torch.nn.Module):
    """An nn.Linear for inference: the same parameters (state dicts, training and export see the plain layer), its
    product through a copy in one of PRODUCT_FORMS while the weight is the one copied and no gradient is wanted,
    else through F.linear. `plain()` gives the nn.Linear back."""

    def __init__(self, layer: torch.nn.Linear, form: str = "packed"):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.form = PRODUCT_FORMS[form](layer.weight.data)
        self.packed_from = (layer.weight.data_ptr(), layer.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or (self.weight.data_ptr(), self.weight._version) != self.packed_from:
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.form, self.bias)

    def plain(self) -> torch.nn.Linear:
        layer = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        layer.weight, layer.bias = self.weight, self.bias
        return layer


# oneDNN's bfloat16 product reduces a K longer than this in an order that depends on how many rows the product has
# (measured: K 1536 gave a row alone and the same row among 2-16 others different last bits for ~15 % of inputs; K up
# to 768 never did). Longer matrices are multiplied in column blocks of at most this many, summed in float32.
MAX_INVARIANT_K = 768


class KSplitWeight:
    """A bfloat16 matrix [N, K] whose product with a row is the same whatever other rows share the product. K is cut
    into `splits` equal blocks of at most MAX_INVARIANT_K, stacked as one [splits * N, K / splits] matrix (a tensor
    or a PackedWeight); a row is multiplied as `splits` rows (its own blocks) by the stacked matrix in one product,
    and the block-by-block products on the diagonal are summed in float32. One read of the weights for `splits`
    times the arithmetic: a decode step is bound by the reading (1 row: 53 against 116 µs for one product per
    block, 2-core EPYC; at 64 rows 612 against 433). `dense` stays for everything else that reads the matrix."""

    def __init__(self, weight: torch.Tensor, packed: bool):
        self.dense = weight
        width = weight.shape[1]
        self.splits = next(s for s in range(2, width + 1) if width % s == 0 and width // s <= MAX_INVARIANT_K)
        stacked = torch.cat(weight.chunk(self.splits, dim=1))
        self.stacked = PackedWeight(stacked) if packed else stacked


class Float32Weight:
    """A bfloat16 matrix kept as a float32 copy, for products with bfloat16 rows where float32 arithmetic is faster
    (prompts of a quantized decoder on a CPU without native bfloat16): the rows are multiplied in float32, padded to
    MIN_ROWS_FLOAT32, packed where oneDNN runs float32, and the result rounded back to bfloat16."""

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
        matrix = weight.float()
        self.product = PackedWeight(matrix) if packing_available(matrix) else matrix


def dense(weight):
    """The plain matrix behind a product form (packed, column-split, float32 or float16 copy); a plain tensor as it
    is."""
    return weight.dense if isinstance(weight, (PackedWeight, KSplitWeight, Float32Weight, Float16Weight)) else weight


def packing_available(weight: torch.Tensor) -> bool:
    """Packed products exist on a CPU torch built with oneDNN: for float32, and for bfloat16 where oneDNN's bfloat16
    kernels run on this CPU."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _onednn_bfloat16_runs())


@functools.cache
def _onednn_bfloat16_runs() -> bool:
    try:  # oneDNN may refuse bfloat16 on a CPU without the instructions for it
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16), weight, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


class Float16Weight:
    """A matrix as FBGEMM's packed float16 weights: float32 rows times float16 weights, summed in float32, through
    AVX2 / AVX-512 kernels on any x86 CPU. Half the bytes of float32, where a bfloat16 product is emulated on CPUs
    without AMX or AVX-512-BF16 (2-core AVX2-only EPYC, 49,152 x 576 at 1 / 8 rows: 3.1 / 5.5 against bfloat16's
    4.5 / 29 ms). A bfloat16 matrix converts exactly but for entries below float16's normal range (2^-14), which move
    by less than 2^-24. FBGEMM multiplies blocks of rows with kernels of several heights that do not all round alike,
    so every product runs at a row count whose kernels agree (float16_row_counts): a row's product does not depend on
    the rows beside it. `dense` stays for everything else that reads the matrix."""

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K] times the matrix, in float32 [n, N]: at most FLOAT16_ROWS rows a call, each call padded."""
        padded_to = float16_row_counts()
        parts = []
        for part in rows.float().split(FLOAT16_ROWS):
            n = part.shape[0]
            part = F.pad(part, (0, 0, 0, padded_to[n] - n))
            parts.append(torch.ops.quantized.linear_dynamic_fp16(part, self.packed)[:n])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


FLOAT16_ROWS = 120  # rows per FBGEMM float16 call (FBGEMM's own block of rows)
# The copies a matrix can be multiplied through beside itself: oneDNN's packed layout, FBGEMM's float16.
PRODUCT_FORMS: dict[str, type[PackedWeight] | type[Float16Weight]] = {"packed": PackedWeight, "float16": Float16Weight}


def float16_available() -> bool:
    """FBGEMM's float16 products exist in x86 CPU builds of torch."""
    return "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def float16_row_counts() -> list[int]:
    """For n rows (1..FLOAT16_ROWS), the row count their FBGEMM float16 product runs at: the smallest >= n whose
    products round every row as most row counts do. Found on this CPU by multiplying copies of one row (FBGEMM picks
    its kernels by the CPU's instructions; on a 2-core AVX2-only EPYC its 1- and 2-row kernels round otherwise than
    its 3- to 6-row ones, so 34 of the counts up to 120 are padded: 1 and 2 to 3, 7 to 8, 14 to 15, 31 and 32 to 33
    ...)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.ops.quantized.linear_prepack_fp16(torch.randn(64, 576, generator=g), None)
    agrees = [True] * (FLOAT16_ROWS + 1)
    for _ in range(2):  # two rows: a kernel that rounds otherwise could agree by chance on one
        row = torch.randn(1, 576, generator=g)
        outs = [torch.ops.quantized.linear_dynamic_fp16(row.expand(n, -1), weight) for n in range(FLOAT16_ROWS + 1)]
        seen = [bytes(out[i].numpy()) for out in outs for i in range(out.shape[0])]
        common = max(set(seen), key=seen.count)
        for n, out in enumerate(outs):
            agrees[n] &= all(bytes(out[i].numpy()) == common for i in range(n))
    if not agrees[FLOAT16_ROWS]:
        raise DSparkError("FBGEMM's float16 product rounds a full block of rows unlike most others on this CPU")
    return [next(m for m in range(n, FLOAT16_ROWS + 1) if agrees[m]) for n in range(FLOAT16_ROWS + 1)]


# A float32 product of fewer rows than this runs another MKL kernel than one of more, which rounds differently
# (measured on a 2-core AMD EPYC: a row's product over 1-3 rows differs from the same row among 4 or more in the
# last bits, while 4-512 rows all agree bitwise, on 1 and 2 threads and for every matrix of the model). A
# batch-invariant float32 decoder pads its products to this many rows; `dspark.autotune` checks the whole forward on
# the machine before `--dtype auto` picks float32. oneDNN's packed float32 product (PackedWeight) agrees from 2 rows
# on (2-core AVX2-only EPYC, 2-300 rows): the same padding covers both forms.
MIN_ROWS_FLOAT32 = 4


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, min_rows: int = 1) -> torch.Tensor:
    """x @ weight.T (+ bias) for a float, packed, column-split, float16, int8 or int4 weight, or a RescoredHead (its
    float32 logits); min_rows: a float product of fewer rows runs padded with zero rows to this many
    (MIN_ROWS_FLOAT32). One kernel for every row count: a row's product does not
    depend on the rows beside it (a separate one-row kernel, faster on some CPUs, would make a plain step round
    differently from a verify)."""
    rows = x.numel() // x.shape[-1]
    # min_rows first: a compiled graph's row count is symbolic. The bias goes inside the padded product.
    if min_rows > 1 and rows < min_rows:
        padded = F.pad(x.reshape(rows, -1), (0, 0, 0, min_rows - rows))
        return linear(padded, weight, bias)[:rows].view(*x.shape[:-1], -1)
    if isinstance(weight, Int8Weight):
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), weight.q, weight.scale)
    elif isinstance(weight, Int4Weight):
        rows_in = x.reshape(-1, x.shape[-1])
        out = torch._weight_int4pack_mm_for_cpu(rows_in, weight.packed, Int4Weight.GROUP, weight.scales_and_zeros)
    elif isinstance(weight, RescoredHead):
        out = weight.logits(x.reshape(rows, -1))
    elif isinstance(weight, PackedWeight):
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), weight.packed, None, "none", [], "")
    elif isinstance(weight, Float32Weight):
        out = linear(x.reshape(rows, -1).float(), weight.product, min_rows=MIN_ROWS_FLOAT32).to(x.dtype)
    elif isinstance(weight, Float16Weight):
        out = weight.product(x.reshape(rows, -1)).to(x.dtype)
    elif isinstance(weight, KSplitWeight):
        n = weight.splits
        parts = linear(x.reshape(rows * n, -1), weight.stacked).view(rows, n, n, -1)
        out = torch.diagonal(parts, dim1=1, dim2=2).sum(-1)  # bfloat16 sums accumulate in float32, round once
    else:
        return F.linear(x, weight, bias)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


PRODUCTS = ("qkv_w", "o_w", "gate_up", "down")  # the matrices of a layer's products, by their names in LeanDecoder
PREFILL_FORMS = ("bfloat16", "float32", "quantized")  # how a quantized decoder multiplies prompts (use_prefill_form)


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linear layers on the same input; each layer's parameters become views of
    it, so the HF module computes exactly what it did and the memory is not doubled."""
    weight = torch.cat([m.weight.data for m in linears])
    has_bias = all(m.bias is not None for m in linears)
    bias = torch.cat([m.bias.data for m in linears]) if has_bias else None
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[row : row + rows]
        if has_bias:
            m.bias.data = bias[row : row + rows]
        row += rows
    return weight, bias


def step_guards(entries) -> list[bool]:
    """Which of Dynamo's guards the compiled step checks at every call (torch.compile's guard_filter_fn): not those
    on the decoder's own state (its weights and sizes, fixed once compiled: LeanDecoder.fixed), nor those on the
    caches of layers 1.. (views of one tensor, shaped as layer 0's). The ~400 guards dropped cost 0.6-1.1 ms of a
    10-12 ms int4 step on a 2-core EPYC; the plan's guards stay, which pick the graph."""
    return [not (e.name.startswith("self") or re.fullmatch(r"(keys|values)\[[1-9]\d*\]", e.name)) for e in entries]


class LeanDecoder:
    def __init__(self, model):
        config = model.config
        if config.model_type not in SUPPORTED_FAMILIES:
            raise DSparkError(
                f"'{config.model_type}' models are not supported yet (supported families: "
                f"{', '.join(SUPPORTED_FAMILIES)}); a new family needs its forward in dspark/decoder.py"
            )
        if getattr(config, "use_sliding_window", False) or getattr(config, "mlp_bias", False):
            raise DSparkError(f"{config.model_type} with a sliding attention window or MLP biases is not supported yet")
        decoder = model.get_decoder()
        attn = decoder.layers[0].self_attn
        gemma = config.model_type in GEMMA_FAMILIES
        self.embed = decoder.embed_tokens.weight
        # Gemma scales the embedding by sqrt(d) (in the model's dtype) and norms by (1 + weight).
        self.embed_scale = config.hidden_size**0.5 if gemma else None
        self.norm = gemma_rms_norm if gemma else rms_norm
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        self.act = ACT2FN[getattr(config, "hidden_activation", None) or config.hidden_act]
        # Gemma 2/3 alternate sliding-window and global layers; Gemma 3 also ropes each kind with its own base.
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.window = getattr(config, "sliding_window", None)
        self.rope_per_type = hasattr(self.rotary, "layer_types")
        self.layers = []
        for layer in decoder.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([a.q_proj, a.k_proj, a.v_proj])
            gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            # Gemma 2/3 norm the attention and MLP outputs too ("sandwich" norms); Gemma names its norms apart.
            pre_ffn = getattr(layer, "pre_feedforward_layernorm", None)
            self.layers.append(
                dict(
                    qkv_w=qkv_w,
                    qkv_b=qkv_b,
                    o_w=a.o_proj.weight,
                    o_b=a.o_proj.bias,
                    gate_up=gate_up,
                    down=mlp.down_proj.weight,
                    in_norm=layer.input_layernorm.weight,
                    post_norm=(pre_ffn if pre_ffn is not None else layer.post_attention_layernorm).weight,
                    attn_out_norm=layer.post_attention_layernorm.weight if pre_ffn is not None else None,
                    mlp_out_norm=getattr(getattr(layer, "post_feedforward_layernorm", None), "weight", None),
                    q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
                    k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
                )
            )
        # On a CPU the forward runs batch-invariant: a row's logits do not depend on how many rows or tokens share
        # it, so speculative output equals plain output token for token. float32 pads its products to
        # MIN_ROWS_FLOAT32 rows for it (`min_rows`); bfloat16's products are invariant as they are, but for long
        # reductions (KSplitWeight). float16 (no fast CPU kernels) and GPUs keep the faster kernels.
        self.batch_invariant = self.embed.dtype in (torch.bfloat16, torch.float32) and self.embed.device.type == "cpu"
        self.min_rows = MIN_ROWS_FLOAT32 if self.batch_invariant and self.embed.dtype == torch.float32 else 1
        self.packed: bool | None = None  # no product form chosen yet (the machine's tuning, dspark.autotune, does)
        self.compiled = None  # the one-row decode step as one compiled graph (compile), or eager
        self.pack(False)
        # A quantized decoder's float matrices, and the form it reads prompts with (use_prefill_form); None: prompts
        # are read like the rest.
        self.float_weights: list[dict] = []
        self.prefill_form: str | None = None
        self.prefill_weights: list[dict] | None = None

    @property
    def compilable(self) -> bool:
        """Whether this model's decode step can run as one compiled graph: int4 layers (bfloat16's packed oneDNN
        weights are opaque to inductor unless frozen into the graph) and batch-invariant attention without Gemma 2's
        soft-capping or sliding windows."""
        return (
            isinstance(self.layers[0]["qkv_w"], Int4Weight)
            and self.batch_invariant
            and not self.softcap
            and "sliding_attention" not in self.layer_types
        )

    def compile(self) -> None:
        """Run every decode forward of one row (a plain step, a verify block; not a prefill) as one graph compiled
        by inductor: a step's ~6,000 small framework calls and the Python between them are what an eager step
        spends beyond its weight stream. The graph's kernels round differently from the eager ones, so a compiled
        decoder refuses batches of several rows rather than mix the two; within it a row's output does not depend
        on how many tokens the forward carries (one graph for every width, its token count symbolic)."""
        if not self.compilable:
            raise DSparkError(
                "--compile runs int4 targets on a CPU (--dtype int4; not soft-capped or sliding-window attention); "
                "run without --compile or with --dtype int4"
            )
        if self.compiled is None:
            # Static unless marked (compiled_forward): with automatic dynamic shapes, a second model compiled in the
            # same process made the first one's weight shapes symbolic, and inductor's code for it failed.
            self.compiled = torch.compile(
                self._one_row_layers, fullgraph=True, dynamic=False, options={"guard_filter_fn": step_guards}
            )

    def fixed(self) -> None:
        """Refuse to change the matrices of a compiled decoder: its graph no longer checks them (step_guards)."""
        if self.compiled is not None:
            raise DSparkError("a compiled target's weights are fixed; load the target again to change them")

    def quantize(self, bits: int) -> float:
        """Weight-only int8 or 4-bit (quantized_weight) for every matrix of every layer (the embedding lookup stays as
        it is). The HF model keeps its float weights: it stays the reference, and a prefill multiplies by them in
        bfloat16 (`use_prefill_form`; the machine's tuning may pick another form). Returns the largest `error` of the
        quantized matrices."""
        self.fixed()
        error = 0.0
        self.float_weights = []
        for p in self.layers:
            self.float_weights.append({name: dense(p[name]) for name in PRODUCTS})
            for name in PRODUCTS:
                p[name] = quantized_weight(dense(p[name]), bits)
                error = max(error, p[name].error)
        self.use_prefill_form("bfloat16")
        return error

    def use_prefill_form(self, form: str) -> None:
        """How a quantized decoder multiplies prompts (one of PREFILL_FORMS): "bfloat16", its float matrices (packed
        where oneDNN runs bfloat16); "float32", copies of them in float32 (Float32Weight); "quantized", its quantized
        matrices. The quantized kernels dequantize the weights again for every few rows, so their cost grows with
        every row, where a float product of a whole prompt is bound by arithmetic; but bfloat16 is emulated on CPUs
        without AMX or AVX-512-BF16. A 150-token prompt's products, 2 threads: 2-core EPYC with AVX-512-BF16, int4
        266 against bfloat16 183 ms; 2-core AVX2-only EPYC, bfloat16 2,714, int4 751, float32 360 ms. Every decoding
        loop prefills alike, so plain and speculative decoding agree whichever form reads the prompts."""
        if form not in PREFILL_FORMS:
            raise DSparkError(f"unknown prefill form {form!r}; one of {', '.join(PREFILL_FORMS)}")
        self.prefill_form = form
        if form == "quantized":
            self.prefill_weights = None
            return
        packed = packing_available(self.float_weights[0]["qkv_w"])

        def prefill_weight(matrix):
            return Float32Weight(matrix) if form == "float32" else self.product_form(matrix, packed)

        self.prefill_weights = [{name: prefill_weight(w) for name, w in layer.items()} for layer in self.float_weights]

    def pack(self, packed: bool) -> None:
        """Every layer's matrices as PackedWeight (or back to the plain tensors); in batch-invariant mode, matrices
        longer than MAX_INVARIANT_K as KSplitWeight. Choosing the form the matrices already have costs nothing."""
        if packed == self.packed:
            return
        self.fixed()
        self.packed = packed
        for p in self.layers:
            for name in PRODUCTS:
                p[name] = self.product_form(p[name], packed)

    def product_form(self, weight, packed: bool):
        matrix = dense(weight)
        if self.batch_invariant and matrix.dtype == torch.bfloat16 and matrix.shape[1] > MAX_INVARIANT_K:
            return KSplitWeight(matrix, packed)
        return PackedWeight(matrix) if packed else matrix

    def new_cache(self, batch_size: int, capacity: int = 0) -> KVCache:
        return KVCache(
            len(self.layers), batch_size, self.kv_heads, self.head_dim, self.embed.dtype, self.embed.device, capacity
        )

    def forward(
        self, cache: KVCache, input_ids: torch.Tensor, num_new: torch.Tensor, capture: list[int], prefill: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Append input_ids [B, W] (row b: its first num_new[b] real) to the cache. Returns the final normed hidden
        states [B, W, d] and the outputs of the `capture` layers. prefill: the rows are prompts (a quantized decoder
        multiplies them by its float matrices)."""
        batch, width = input_ids.shape
        if self.compiled is not None and not prefill:
            return self.compiled_forward(cache, input_ids, num_new, capture)
        slots = cache.open(width)
        positions = slots.positions
        upto = int(positions[:, -1].max()) + 1
        # One token per row at one common length sees every slot up to itself: no mask at all. Rows that all start at
        # slot 0 (a prefill, a training sequence) are plain causal attention: no mask either, which lets SDPA take its
        # fused kernels (on CUDA, flash) instead of reading a [W, W] mask.
        causal = slots.start == 0 and width > 1 and not self.softcap
        # Batch-invariant attention plans its own key lengths and masks, per query (plan_buckets).
        bucketed = self.batch_invariant and not self.softcap and "sliding_attention" not in self.layer_types
        groups = plan_buckets(positions, self.heads // self.kv_heads, self.embed.dtype) if bucketed else None
        one_step = width == 1 and slots.start is not None
        full = None if bucketed or one_step or causal else causal_visibility(positions, upto)
        masks = {"full_attention": full}
        if "sliding_attention" in self.layer_types:
            # A sliding layer sees the last `window` positions (itself included) of its own row.
            seen = torch.arange(upto, device=positions.device)[None, None, :] > positions[:, :, None] - self.window
            masks["sliding_attention"] = causal_visibility(positions, upto) & seen[:, None]
        # A ragged forward (rows with fewer real tokens than the widest: a scheduled verify, a prefill of prompts of
        # several lengths) runs every per-token operation on its real tokens only, packed [T, d]; only attention sees
        # the padded [B, W] layout. Its cost follows the tokens it carries, not rows x the longest.
        real = real_positions(num_new, width)

        def padded(t: torch.Tensor) -> torch.Tensor:
            if real is None:
                return t
            out = t.new_zeros(batch, width, t.shape[-1])
            out[real] = t
            return out

        x = F.embedding(input_ids if real is None else input_ids[real], self.embed)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = {
            t: self.rotary(x, positions, t) if self.rope_per_type else self.rotary(x, positions)
            for t in set(self.layer_types)
        }
        q_size = self.heads * self.head_dim
        norm, eps = self.norm, self.eps
        project = functools.partial(linear, min_rows=self.min_rows)
        wanted, captured = set(capture), {}
        matrices = self.prefill_weights if prefill and self.prefill_weights is not None else self.layers
        for i, p in enumerate(self.layers):
            w = matrices[i]
            cos, sin = rope[self.layer_types[i]]
            mask = masks[self.layer_types[i]]
            h = norm(x, p["in_norm"], eps)
            qkv = padded(project(h, w["qkv_w"], p["qkv_b"])).view(batch, width, -1, self.head_dim).transpose(1, 2)
            q, k, v = self._queries_keys(qkv, p, cos, sin)
            cache.write(i, k, v, slots)
            if groups is not None:
                out = bucketed_attention(q, cache.k[i], cache.v[i], groups, self.scaling)
            elif self.softcap:
                out = softcapped_attention(q, *cache.view(i, upto), mask, self.scaling, self.softcap)
            else:
                out = attention(q, *cache.view(i, upto), mask, self.scaling, causal=causal and mask is None)
            out = out.transpose(1, 2).reshape(batch, width, q_size)
            x = self._after_attention(x, out if real is None else out[real], p, w, project)
            if i in wanted:
                captured[i] = x
        cache.advance(num_new)
        return padded(norm(x, self.final_norm, eps)), [padded(captured[i]) for i in capture]

    def _queries_keys(self, qkv: torch.Tensor, p: dict, cos, sin):
        """A layer's queries, keys and values from its q/k/v product [B, heads, W, hd], queries and keys roped (in
        one pass; Qwen3 and Gemma 3 norm every query and key head first)."""
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        if p["q_norm"] is None:
            q, k = rotate(qkv[:, : self.heads + self.kv_heads], cos, sin).split([self.heads, self.kv_heads], dim=1)
        else:
            q = rotate(self.norm(q, p["q_norm"], self.eps), cos, sin)
            k = rotate(self.norm(k, p["k_norm"], self.eps), cos, sin)
        return q, k, v

    def _after_attention(self, x: torch.Tensor, attended: torch.Tensor, p: dict, w: dict, project) -> torch.Tensor:
        """The rest of a layer once attention has run: the output product, the residual, the MLP and its residual
        (Gemma 2/3's sandwich norms where the layer has them); products by `project` over the matrices `w`."""
        out = project(attended, w["o_w"], p["o_b"])
        x = x + (out if p["attn_out_norm"] is None else self.norm(out, p["attn_out_norm"], self.eps))
        gate, up = project(self.norm(x, p["post_norm"], self.eps), w["gate_up"]).chunk(2, dim=-1)
        out = project(self.act(gate) * up, w["down"])
        return x + (out if p["mlp_out_norm"] is None else self.norm(out, p["mlp_out_norm"], self.eps))

    def compiled_forward(
        self, cache: KVCache, input_ids: torch.Tensor, num_new: torch.Tensor, capture: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` of one row through the compiled graph: the attention plan, rotary angles and embedding are
        computed here, everything per layer inside it."""
        batch, width = input_ids.shape
        if batch != 1 or int(num_new[0]) != width:
            raise DSparkError(
                "a compiled target decodes one request at a time (its kernels round unlike the eager ones that a "
                "batch of several rows would run); run without --compile to batch requests"
            )
        # Room past the last key any query reads: a read that ends at the cache's end would be a different graph.
        cache.reserve(width + GRANULE)
        slots = cache.open(width)
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, slots.positions)
        written = slots.positions[0]
        # cols cloned: as a view of nonzero's output it would tie the graph to its base's size.
        plan = [
            (g.padded, None if g.cols is None else g.cols.clone(), g.mask)
            for g in plan_buckets(slots.positions, self.heads // self.kv_heads, x.dtype)
        ]
        # Every size that changes from call to call is marked symbolic: the width (1 included, so unbacked), the
        # query groups' sizes and key ends, the cache's capacity. The number of groups is not: one graph for a block
        # whose queries read one 64-key group, one for a block that crosses into the next.
        for t in (x, cos, sin):
            torch._dynamo.decorators.mark_unbacked(t, 1)
        torch._dynamo.decorators.mark_unbacked(written, 0)
        keys, values = list(cache.k.unbind(0)), list(cache.v.unbind(0))
        for padded, cols, mask in plan:
            for t, dim in ((padded, 0), (mask, 2), (mask, 3)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
            if cols is not None:
                torch._dynamo.decorators.mark_unbacked(cols, 0)
        for t in keys + values:
            torch._dynamo.maybe_mark_dynamic(t, 2)  # the cache's capacity grows
        hidden, outputs = self.compiled(x, cos, sin, written, keys, values, plan)
        cache.advance(num_new)
        return hidden, [outputs[i] for i in capture]

    def _one_row_layers(self, x, cos, sin, slots, keys, values, plan):
        """The layers over one row's new tokens x [1, W, d] at cache slots `slots` [W] (keys/values: each layer's
        cache, written in place), attention as `bucketed_attention` plans it: per group, the query columns sent to
        SDPA (padded), the columns it answers (cols, None: all) and its mask. Returns the final normed hidden states
        and every layer's output (any of them may be a drafter's feature; they exist anyway, and one graph serves
        every choice). Compiled by `compile`."""
        _, width, _ = x.shape
        q_size = self.heads * self.head_dim
        outputs = []
        for i, p in enumerate(self.layers):
            h = self.norm(x, p["in_norm"], self.eps)
            qkv = linear(h, p["qkv_w"], p["qkv_b"]).view(1, width, -1, self.head_dim).transpose(1, 2)
            q, k, v = self._queries_keys(qkv, p, cos, sin)
            keys[i].index_copy_(2, slots, k)
            values[i].index_copy_(2, slots, v)
            out = q.new_empty(q.shape)
            for padded, cols, mask in plan:
                end = mask.shape[-1]
                part = folded_attention(q[:, :, padded], keys[i][:, :, :end], values[i][:, :, :end], mask, self.scaling)
                if cols is None:
                    out = part[:, :, :width]
                else:
                    out[:, :, cols] = part[:, :, : cols.shape[0]]
            x = self._after_attention(x, out.transpose(1, 2).reshape(1, width, q_size), p, p, linear)
            outputs.append(x)
        return self.norm(x, self.final_norm, self.eps), outputs
