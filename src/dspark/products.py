"""Every form a weight matrix is multiplied in, and `linear`, the one product the decoder and the drafter call:
float (padded to MIN_ROWS_FLOAT32 rows where float32 must stay batch-invariant), oneDNN-packed, column-split for long
bfloat16 reductions, float32 copies, FBGEMM float16, weight-only int8 and int4, and the rescored 4-bit LM head.

A form is swapped in where a plain matrix was and shares one small interface: called on rows [n, K] it returns their
products [n, N]; `dense` is the plain matrix it was made from (what everything else reads: training, export, another
form); `nbytes`, what one product streams. The decoder and the LM head never ask which form they hold."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dspark.errors import DSparkError


class Int8Weight:
    """A weight-only int8 matrix: per-output-channel scales, products in the activations' precision."""

    error = float("inf")  # rounding moves weights of every float model (see Int4Weight.error)

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
        scale = weight.float().abs().amax(dim=1).clamp_min(1e-8) / 127
        self.q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(weight.dtype)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.q, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Weight:
    """A weight-only 4-bit matrix: each group of GROUP input columns of a row has its own step and minimum, 16 levels
    from min to max (llama.cpp's Q4_1 layout: weights dequantized from a Q4_1 file get their own grid back exactly),
    multiplied with bfloat16 activations by PyTorch's int4 CPU kernel. Its product of a row does not depend on the
    rows beside it (tested on the real target). `error`: the largest change rounding made to a weight, relative to
    the largest weight of its group (weights from a Q4_1 file, read in bfloat16: ~2^-8; a float model's: ~1/15)."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
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

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.GROUP, self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


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
        self.coarse = Int4Weight(F.pad(weight, (0, 0, 0, -vocab % 16)) if vocab % 16 else weight)  # rows by 16

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, V] of hidden states [n, d]; a row's do not depend on the rows beside it."""
        scores = self.coarse(rows.bfloat16())[:, : self.dense.shape[0]].float()  # the kernel's activations
        best = scores.topk(min(self.CANDIDATES, scores.shape[-1]), dim=-1, sorted=False).indices
        exact = (self.dense[best].float() * rows.float()[:, None, :]).sum(-1)
        return scores.scatter_(1, best, exact)

    @property
    def nbytes(self) -> int:
        return self.coarse.nbytes  # and CANDIDATES rows of the full matrix per row


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

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes


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

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        n = self.splits
        parts = linear(rows.reshape(rows.shape[0] * n, -1), self.stacked).view(rows.shape[0], n, n, -1)
        return torch.diagonal(parts, dim1=1, dim2=2).sum(-1)  # bfloat16 sums accumulate in float32, round once

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes


class Float32Weight:
    """A bfloat16 matrix kept as a float32 copy, for products with bfloat16 rows where float32 arithmetic is faster
    (prompts of a quantized decoder on a CPU without native bfloat16): the rows are multiplied in float32, padded to
    MIN_ROWS_FLOAT32, packed where oneDNN runs float32, and the result rounded back to bfloat16."""

    def __init__(self, weight: torch.Tensor):
        self.dense = weight
        matrix = weight.float()
        self.product = PackedWeight(matrix) if packing_available(matrix) else matrix

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return linear(rows.float(), self.product, min_rows=MIN_ROWS_FLOAT32).to(rows.dtype)

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes * 2


def dense(weight):
    """The plain matrix behind a product form; a plain tensor as it is."""
    return getattr(weight, "dense", weight)


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

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K] times the matrix [n, N], summed in float32 and rounded to the rows' precision (float32 rows
        keep the sums): at most FLOAT16_ROWS rows a call, each call padded."""
        padded_to = float16_row_counts()
        parts = []
        for part in rows.float().split(FLOAT16_ROWS):
            n = part.shape[0]
            part = F.pad(part, (0, 0, 0, padded_to[n] - n))
            parts.append(torch.ops.quantized.linear_dynamic_fp16(part, self.packed)[:n])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(rows.dtype)

    @property
    def nbytes(self) -> int:
        return self.dense.numel() * 2


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
    """x @ weight.T (+ bias) for a plain matrix or any form of one (a RescoredHead gives float32 logits); min_rows: a
    product of fewer rows runs padded with zero rows to this many (MIN_ROWS_FLOAT32). One kernel for every row count:
    a row's product does not depend on the rows beside it (a separate one-row kernel, faster on some CPUs, would make
    a plain step round differently from a verify)."""
    rows = x.numel() // x.shape[-1]
    # min_rows first: a compiled graph's row count is symbolic. The bias goes inside the padded product.
    if min_rows > 1 and rows < min_rows:
        padded = F.pad(x.reshape(rows, -1), (0, 0, 0, min_rows - rows))
        return linear(padded, weight, bias)[:rows].view(*x.shape[:-1], -1)
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight(x.reshape(rows, -1))  # every form multiplies rows [n, K]
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias
