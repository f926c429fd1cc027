"""Attention that reads a row's keys the same way whatever shares its call (batch-invariant on a CPU): SDPA with
query heads folded in, queries grouped by the key length they read (rounded up to the cache's granule), and the
soft-capped attention of Gemma 2 that SDPA cannot express."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dspark.kvcache import GRANULE


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
