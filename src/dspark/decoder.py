"""Our own forward of a pre-norm decoder LM (Llama, Qwen2, Qwen3, Gemma 1/2/3) over the position-addressed KV cache.

Hugging Face loads the weights and stays the reference (the tests hold this forward to its logits and hidden
states); the forward is ours because the per-token cost of a 135M model on a CPU is mostly framework overhead:
module dispatch, masks and cache objects rebuilt per call. Here q/k/v and gate/up are fused into one matrix each
(the HF modules keep working on views of the fused weights, so nothing is stored twice), no mask is built where a
batch is not ragged and carries one token, and the LM head runs only where the caller wants logits.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from dspark.attention import attention, bucketed_attention, folded_attention, plan_buckets, softcapped_attention
from dspark.errors import DSparkError
from dspark.kvcache import GRANULE, KVCache, causal_visibility
from dspark.products import (
    MAX_INVARIANT_K,
    MIN_ROWS_FLOAT32,
    Float32Weight,
    Int4Weight,
    KSplitWeight,
    PackedWeight,
    dense,
    linear,
    packing_available,
    quantized_weight,
)

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


PRODUCTS = ("qkv", "out", "gate_up", "down")  # the fields of Layer that are multiplied by


@dataclass
class Layer:
    """One decoder layer's weights. The four products are plain matrices or any form of one (products.py: packed,
    column-split, quantized ...), swapped in without the forward knowing which; norms the family lacks are None."""

    qkv: Any  # q, k and v fused
    out: Any
    gate_up: Any  # gate and up fused
    down: Any
    qkv_bias: torch.Tensor | None
    out_bias: torch.Tensor | None
    in_norm: torch.Tensor
    post_norm: torch.Tensor  # before the MLP
    attn_out_norm: torch.Tensor | None  # Gemma 2/3's "sandwich" norms of the attention and MLP outputs
    mlp_out_norm: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3 and Gemma 3 norm every query and key head
    k_norm: torch.Tensor | None

    def with_products(self, form) -> Layer:
        """This layer with each product's matrix in `form` (a function of the plain matrix)."""
        return dataclasses.replace(self, **{name: form(dense(getattr(self, name))) for name in PRODUCTS})


def read_layer(layer) -> Layer:
    a, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj])
    gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    # Gemma names its norms apart: pre_feedforward_layernorm where it has sandwich norms.
    pre_ffn = getattr(layer, "pre_feedforward_layernorm", None)
    return Layer(
        qkv=qkv,
        out=a.o_proj.weight,
        gate_up=gate_up,
        down=mlp.down_proj.weight,
        qkv_bias=qkv_bias,
        out_bias=a.o_proj.bias,
        in_norm=layer.input_layernorm.weight,
        post_norm=(pre_ffn if pre_ffn is not None else layer.post_attention_layernorm).weight,
        attn_out_norm=layer.post_attention_layernorm.weight if pre_ffn is not None else None,
        mlp_out_norm=getattr(getattr(layer, "post_feedforward_layernorm", None), "weight", None),
        q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
        k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
    )


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
        self.layers = [read_layer(layer) for layer in decoder.layers]
        # On a CPU the forward runs batch-invariant: a row's logits do not depend on how many rows or tokens share
        # it, so speculative output equals plain output token for token. float32 pads its products to
        # MIN_ROWS_FLOAT32 rows for it (`min_rows`); bfloat16's products are invariant as they are, but for long
        # reductions (KSplitWeight). float16 (no fast CPU kernels) and GPUs keep the faster kernels.
        self.batch_invariant = self.embed.dtype in (torch.bfloat16, torch.float32) and self.embed.device.type == "cpu"
        self.min_rows = MIN_ROWS_FLOAT32 if self.batch_invariant and self.embed.dtype == torch.float32 else 1
        self.packed: bool | None = None  # no product form chosen yet (the machine's tuning, dspark.autotune, does)
        self.compiled = None  # the one-row decode step as one compiled graph (compile), or eager
        self.quantized = False
        self.pack(False)
        # How a quantized decoder reads prompts (use_prefill_form), and its layers in that form; None: like the rest.
        self.prefill_form: str | None = None
        self.prefill_layers: list[Layer] | None = None

    @property
    def compilable(self) -> bool:
        """Whether this model's decode step can run as one compiled graph: int4 layers (bfloat16's packed oneDNN
        weights are opaque to inductor unless frozen into the graph) and batch-invariant attention without Gemma 2's
        soft-capping or sliding windows."""
        return (
            isinstance(self.layers[0].qkv, Int4Weight)
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
        it is). The HF model keeps its float weights (each quantized form's `dense`): it stays the reference, and a
        prefill multiplies by them in bfloat16 (`use_prefill_form`; the machine's tuning may pick another form).
        Returns the largest `error` of the quantized matrices."""
        self.fixed()
        self.layers = [layer.with_products(lambda matrix: quantized_weight(matrix, bits)) for layer in self.layers]
        self.quantized = True
        self.use_prefill_form("bfloat16")
        return max(getattr(layer, name).error for layer in self.layers for name in PRODUCTS)

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
            self.prefill_layers = None
            return
        packed = packing_available(dense(self.layers[0].qkv))

        def prefill_weight(matrix):
            return Float32Weight(matrix) if form == "float32" else self.product_form(matrix, packed)

        self.prefill_layers = [layer.with_products(prefill_weight) for layer in self.layers]

    def pack(self, packed: bool) -> None:
        """Every layer's matrices as PackedWeight (or back to the plain tensors); in batch-invariant mode, matrices
        longer than MAX_INVARIANT_K as KSplitWeight. Choosing the form the matrices already have costs nothing."""
        if packed == self.packed:
            return
        self.fixed()
        if self.quantized:
            raise DSparkError("a quantized decoder's matrices keep their quantized form")
        self.packed = packed
        self.layers = [
            layer.with_products(functools.partial(self.product_form, packed=packed)) for layer in self.layers
        ]

    def product_form(self, matrix: torch.Tensor, packed: bool):
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
        project = functools.partial(linear, min_rows=self.min_rows)
        wanted, captured = set(capture), {}
        layers = self.prefill_layers if prefill and self.prefill_layers is not None else self.layers
        for i, layer in enumerate(layers):
            mask = masks[self.layer_types[i]]

            def attend(q, k, v, i=i, mask=mask):
                cache.write(i, k, v, slots)
                if groups is not None:
                    return bucketed_attention(q, cache.k[i], cache.v[i], groups, self.scaling)
                if self.softcap:
                    return softcapped_attention(q, *cache.view(i, upto), mask, self.scaling, self.softcap)
                return attention(q, *cache.view(i, upto), mask, self.scaling, causal=causal and mask is None)

            cos, sin = rope[self.layer_types[i]]
            x = self._layer(x, layer, cos, sin, attend, project, (batch, width), padded, real)
            if i in wanted:
                captured[i] = x
        cache.advance(num_new)
        return padded(self.norm(x, self.final_norm, self.eps)), [padded(captured[i]) for i in capture]

    def _layer(self, x, layer: Layer, cos, sin, attend, project, shape, padded=None, real=None) -> torch.Tensor:
        """One layer over new tokens x (packed [T, d] where `real` picks them out of the [B, W] layout `padded`
        restores; else [B, W, d]), for the eager and the compiled forward alike: q/k/v, roped (Qwen3 and Gemma 3 norm
        every query and key head first), `attend(q, k, v)` [B, heads, W, hd] (which writes the cache), the output
        product, the MLP, their residuals and Gemma 2/3's sandwich norms. Products by `project`."""
        batch, width = shape
        norm, eps = self.norm, self.eps
        qkv = project(norm(x, layer.in_norm, eps), layer.qkv, layer.qkv_bias)
        qkv = (qkv if padded is None else padded(qkv)).view(batch, width, -1, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        if layer.q_norm is None:
            q, k = rotate(qkv[:, : self.heads + self.kv_heads], cos, sin).split([self.heads, self.kv_heads], dim=1)
        else:
            q, k = rotate(norm(q, layer.q_norm, eps), cos, sin), rotate(norm(k, layer.k_norm, eps), cos, sin)
        attended = attend(q, k, v).transpose(1, 2).reshape(batch, width, self.heads * self.head_dim)
        out = project(attended if real is None else attended[real], layer.out, layer.out_bias)
        x = x + (out if layer.attn_out_norm is None else norm(out, layer.attn_out_norm, eps))
        gate, up = project(norm(x, layer.post_norm, eps), layer.gate_up).chunk(2, dim=-1)
        out = project(self.act(gate) * up, layer.down)
        return x + (out if layer.mlp_out_norm is None else norm(out, layer.mlp_out_norm, eps))

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
        outputs = []
        for i, layer in enumerate(self.layers):

            def attend(q, k, v, i=i):
                keys[i].index_copy_(2, slots, k)
                values[i].index_copy_(2, slots, v)
                out = q.new_empty(q.shape)
                for padded, cols, mask in plan:
                    end = mask.shape[-1]
                    part = folded_attention(
                        q[:, :, padded], keys[i][:, :, :end], values[i][:, :, :end], mask, self.scaling
                    )
                    if cols is None:
                        out = part[:, :, :width]
                    else:
                        out[:, :, cols] = part[:, :, : cols.shape[0]]
                return out

            x = self._layer(x, layer, cos, sin, attend, linear, (1, width))
            outputs.append(x)
        return self.norm(x, self.final_norm, self.eps), outputs
