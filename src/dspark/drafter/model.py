"""DSparkDrafter: the whole drafter (docs/design.md §2) with its training forward, its inference `propose`, and checkpoints.

Embedding and LM head are the target's, shared by reference and frozen: they are non-persistent buffers, so they
never enter a checkpoint. With a reduced draft vocabulary (`draft_vocab_size`), the head scores only the `d2t`
subset of the target's vocabulary and proposals are mapped back to target ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.decoder import GEMMA_FAMILIES
from dspark.drafter.backbone import LayerProducts, backbone_layout, check_layer_layout, context_kv, layer_forward
from dspark.drafter.config import DSparkConfig
from dspark.drafter.heads import MARKOV_HEADS, ConfidenceHead
from dspark.errors import DSparkError
from dspark.fsutil import atomic_dir
from dspark.kvcache import KVCache
from dspark.products import (
    PRODUCT_FORMS,
    Float16Weight,
    PackedLinear,
    PackedWeight,
    float16_available,
    linear,
    packing_available,
)
from dspark.proposer import Proposal
from dspark.sampling import Sampling, all_greedy, rows_to_probs, sample_rows

CHECKPOINT_FORMAT = "dspark-drafter"
FORMAT_VERSION = 2  # 2: model.safetensors metadata repeats WEIGHT_SHAPING_FIELDS
WEIGHT_SHAPING_FIELDS = (
    "architecture",
    "block_size",
    "num_draft_layers",
    "target_layer_ids",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "draft_vocab_size",
    "backbone",
)


# What a Qwen3-style layer has and a warm start from another family's layer lacks: kept at their start (norm
# weights at one, bias at zero) when weights are copied in.
PORTABLE_EXTRAS = ("q_norm.weight", "k_norm.weight", "o_proj.bias")


def only_portable_extras(missing_keys) -> bool:
    return all(k.endswith(PORTABLE_EXTRAS) for k in missing_keys)


def gemma_as_qwen3(state: dict) -> dict:
    """A Gemma layer's weights as a warm start for a Qwen3-style layer: Gemma norms scale by (1 + w), Qwen3's by w,
    so the pre-norms convert exactly; the sandwich norms after attention and MLP have no place and are dropped."""
    renamed = {"pre_feedforward_layernorm.weight": "post_attention_layernorm.weight"}
    out = {}
    for name, value in state.items():
        if name in ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"):
            continue
        name = renamed.get(name, name)
        out[name] = value + 1 if name.endswith("norm.weight") else value
    return out


def with_zero_inputs(linear: nn.Linear, extra: int) -> nn.Linear:
    """`linear` reading `extra` more inputs after its own, with zero weight on them: the same outputs as before."""
    wide = nn.Linear(linear.in_features + extra, linear.out_features, bias=linear.bias is not None).to(linear.weight)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:, : linear.in_features] = linear.weight
        if linear.bias is not None:
            wide.bias.copy_(linear.bias)
    return wide


@dataclass
class TrainOutput:
    logits: torch.Tensor  # [B, A, γ, Vd] draft logits, sequential bias included
    confidence_logits: torch.Tensor | None  # [B, A, γ]
    labels: torch.Tensor  # [B, A, γ] target ids of the γ tokens after each anchor (clamped at the sequence end)


class DraftCache(KVCache):
    """The drafter's context: per draft layer, keys/values of the fused target features of accepted tokens, plus
    any per-row tensors a drafter keeps between rounds (`row_state`, kept in step with the rows)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_state: dict[str, torch.Tensor] = {}

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.row_state = {k: v[rows] for k, v in self.row_state.items()}

    def merge(self, other: DraftCache) -> None:  # type: ignore[override]
        super().merge(other)
        self.row_state = {k: torch.cat([v, other.row_state[k]]) for k, v in self.row_state.items()} or other.row_state


class DSparkDrafter(nn.Module):
    def __init__(self, config: DSparkConfig, target_config, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        vocab_size, hidden = lm_head_weight.shape
        config.validate(target_config.num_hidden_layers, vocab_size)
        self.config = config
        self.target_config = target_config
        layer_config, (layer_cls, norm_cls, rotary_cls) = backbone_layout(target_config, config.backbone)
        eps = getattr(target_config, "rms_norm_eps", 1e-6)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList(layer_cls(layer_config, i) for i in range(config.num_draft_layers))
        check_layer_layout(self.layers[0], layer_config.model_type)
        self.norm = norm_cls(hidden, eps=eps)
        self.rotary_emb = rotary_cls(config=layer_config)
        draft_vocab = config.draft_vocab_size or vocab_size
        rank = config.markov_rank
        self.markov_head = (
            MARKOV_HEADS[config.markov_head_type](vocab_size, rank, hidden, draft_vocab) if rank > 0 else None
        )
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(hidden + (rank if config.confidence_head_with_markov else 0))
        # Block tokens enter as the target embeds them: Gemma scales its embedding by sqrt(d).
        self.embed_scale = hidden**0.5 if target_config.model_type in GEMMA_FAMILIES else None
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)
        self._lm_slice = None
        self._packed_lm: PackedWeight | Float16Weight | None = None
        self._layer_products: list[LayerProducts] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self._init_weights(self)
        if self.markov_head is not None:
            # The sequential bias starts at zero: training begins from the pure parallel drafter.
            nn.init.zeros_(self.markov_head.markov_w2.weight)

    def _init_weights(self, root: nn.Module) -> None:
        std = getattr(self.target_config, "initializer_range", 0.02)
        for module in root.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif hasattr(module, "weight") and module.__class__.__name__.endswith("RMSNorm"):
                nn.init.ones_(module.weight)

    def init_from_target_layers(self, target_model) -> list[int]:
        """Copy the target's top decoder layers (and final norm) into the backbone. Returns the layers used."""
        source = target_model.get_decoder().layers
        first = len(source) - len(self.layers)
        for layer, src in zip(self.layers, source[first:]):
            self._copy_target_layer(layer, src)
        self.norm.load_state_dict(self._target_state(target_model.get_decoder().norm))
        return list(range(first, len(source)))

    def _target_state(self, module: nn.Module) -> dict:
        """A target module's weights as this backbone names and scales them."""
        state = module.state_dict()
        return gemma_as_qwen3(state) if self.target_config.model_type in GEMMA_FAMILIES else state

    def _copy_target_layer(self, layer: nn.Module, src: nn.Module) -> None:
        state = self._target_state(src)
        # A Qwen3-style backbone over another family keeps its q/k norms at their start (ones) and, over Qwen2,
        # its output-projection bias at zero; nothing else may be left out.
        missing, unexpected = layer.load_state_dict(state, strict=False)
        if unexpected or not only_portable_extras(missing):
            raise DSparkError(
                f"the target's layers do not fit this backbone (missing {missing}, unexpected "
                f"{unexpected}); train with --no-init-target-layers"
            )

    def add_layers(self, count: int, target_model=None) -> None:
        """Deepen a trained drafter: append `count` decoder layers after its last. Each starts as an identity (its
        attention output and MLP down projections at zero), so the drafter proposes exactly as before and training
        grows the new capacity from there; with target_model, their other weights start as the target's top layers
        would in a backbone of the new depth."""
        if self.config.architecture != "dspark":
            raise DSparkError(f"only DSpark drafters can be deepened; this one is {self.config.architecture}")
        layer_config, (layer_cls, _, _) = backbone_layout(self.target_config, self.config.backbone)
        depth = len(self.layers) + count
        source = target_model.get_decoder().layers if target_model is not None else None
        for i in range(len(self.layers), depth):
            layer = layer_cls(layer_config, i).to(self.fc.weight)
            self._init_weights(layer)
            if source is not None:
                self._copy_target_layer(layer, source[len(source) - depth + i])
            with torch.no_grad():
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
            self.layers.append(layer)
        self.config.num_draft_layers = depth

    # ---- shared pieces --------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or int(self.lm_head_weight.shape[0])

    def lm_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows of the shared LM head that the drafter scores, in `dtype`; rebuilt only when d2t or dtype change."""
        if self.d2t is None and self.lm_head_weight.dtype == dtype:
            return self.lm_head_weight  # type: ignore[return-value]
        d2t_key = None if self.d2t is None else (self.d2t.data_ptr(), self.d2t._version)
        key = (d2t_key, self.lm_head_weight.data_ptr(), dtype)
        if self._lm_slice is None or self._lm_slice[0] != key:
            weight = self.lm_head_weight if self.d2t is None else self.lm_head_weight.index_select(0, self.d2t)
            self._lm_slice = (key, weight.to(dtype))  # type: ignore[assignment]
        return self._lm_slice[1]

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        if self.d2t is None or d2t.shape != self.d2t.shape:
            raise DSparkError(f"draft vocabulary must have {self.draft_vocab_size} ids")
        self.d2t.copy_(d2t.to(self.d2t))

    def widen_draft_vocab(self, extra_ids: torch.Tensor) -> None:
        """Add these target ids to a reduced draft vocabulary (kept sorted). The Markov head keeps its rows for the ids
        already there and starts the new ones at zero (no sequential bias until trained). The new ids' base logits
        come from the shared LM head, which the drafter was never trained against for them: widen, then train (on
        the shipped drafter, widening alone moved real τ by -0.01)."""
        if self.d2t is None:
            raise DSparkError("this drafter scores the whole vocabulary already; there is nothing to widen")
        merged = torch.cat([self.d2t, extra_ids.to(self.d2t)]).unique()  # sorted
        kept_rows = torch.searchsorted(merged, self.d2t)
        if self.markov_head is not None:
            old = self.markov_head.markov_w2
            wide = nn.Linear(old.in_features, len(merged), bias=False).to(old.weight)
            with torch.no_grad():
                wide.weight.zero_()
                wide.weight[kept_rows] = old.weight
            self.markov_head.markov_w2 = wide
        self.d2t = merged
        self.config.draft_vocab_size = len(merged)
        self._lm_slice = None

    def widen_markov_rank(self, rank: int) -> None:
        """Give a trained vanilla Markov head `rank` dimensions instead of its own: the new embedding columns start
        random, their projection to the logits (and the confidence head's weights on them) at zero, so the drafter
        proposes exactly as before and training grows the new capacity (from scratch at equal steps, rank 256 beat 64
        by 0.065 mean real τ on the shipped target: docs/experiments.md)."""
        head = self.markov_head
        if type(head) is not MARKOV_HEADS["vanilla"]:
            raise DSparkError("only a vanilla Markov head can be widened; this drafter's is not one")
        old = head.rank
        if rank < old:
            raise DSparkError(f"the Markov rank can only grow: the drafter has {old}, asked for {rank}")
        if rank == old:
            return
        w1 = nn.Embedding(head.markov_w1.num_embeddings, rank).to(head.markov_w1.weight)
        with torch.no_grad():
            nn.init.normal_(w1.weight, std=getattr(self.target_config, "initializer_range", 0.02))
            w1.weight[:, :old] = head.markov_w1.weight
        head.markov_w1, head.markov_w2, head.rank = w1, with_zero_inputs(head.markov_w2, rank - old), rank
        if self.confidence_head is not None and self.config.confidence_head_with_markov:
            self.confidence_head.proj = with_zero_inputs(self.confidence_head.proj, rank - old)
        self.config.markov_rank = rank

    def t2d(self) -> torch.Tensor | None:
        """Target id -> draft id, -1 where the target token is outside the draft vocabulary."""
        if self.d2t is None:
            return None
        table = torch.full((self.lm_head_weight.shape[0],), -1, dtype=torch.long, device=self.d2t.device)
        table[self.d2t] = torch.arange(len(self.d2t), device=self.d2t.device)
        return table

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """ctx = hidden_norm(fc(concat of captured layers)), each layer RMS-normalised first if feature_norm."""
        features = features.to(self.fc.weight.dtype)
        if self.config.feature_norm:
            parts = features.unflatten(-1, (len(self.config.target_layer_ids), -1)).float()
            parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-6)
            features = parts.flatten(-2).to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ctx = self.fuse(features)
        cos, sin = self.rotary_emb(ctx, positions)
        return [context_kv(layer, ctx, cos, sin, products) for layer, products in self.layers_for_inference()]

    def backbone(self, block_ids, positions, ctx_kv, mask) -> torch.Tensor:
        """Block token ids [B, Q] at positions [B, Q] -> normed hidden states h [B, Q, d]."""
        x = nn.functional.embedding(block_ids, self.embed_weight).to(self.fc.weight.dtype)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary_emb(x, positions)
        for (layer, products), (k, v) in zip(self.layers_for_inference(), ctx_kv):
            x = layer_forward(layer, x, cos, sin, k, v, mask, products)[0]
        return self.norm(x)

    def layers_for_inference(self) -> list[tuple[nn.Module, LayerProducts | None]]:
        """Each draft layer with its packed products (None where the drafter is not packed, or was deepened after)."""
        if self._layer_products is None or len(self._layer_products) != len(self.layers):
            return [(layer, None) for layer in self.layers]
        return list(zip(self.layers, self._layer_products))

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.lm_weight(h.dtype)
        if self._packed_lm is None or torch.is_grad_enabled():
            return (h @ weight.T).float()
        if self._packed_lm.dense is not weight:  # the draft vocabulary or the dtype changed since packing
            self._packed_lm = type(self._packed_lm)(weight)
        return linear(h, self._packed_lm).float()

    def use_product_form(self, form: str) -> DSparkDrafter:
        """For inference: every matrix a proposal multiplies by in one of decoder.PRODUCT_FORMS ("packed": oneDNN's
        packed weights, as the target's; "float16": FBGEMM's, where the machine's tuning found them faster for the
        target's LM head), or "plain" back: the draft layers' through LayerProducts (the matrices that read one
        input stacked into one product), the others through products.PackedLinear. A form this machine lacks is
        plain. Parameters and checkpoints are unchanged. Drafts need not be bitwise the same in every form:
        verification decides what is emitted (1 row, γ = 7: 2-core EPYC with AVX-512-BF16, 4.2 -> 3.4 ms packed;
        2-core AVX2-only EPYC, where bfloat16 is emulated, 16 -> 8 ms in float16)."""
        available = {"packed": packing_available(self.fc.weight), "float16": float16_available()}
        if form not in PRODUCT_FORMS and form != "plain":
            raise DSparkError(f"unknown product form {form!r}; one of plain, {', '.join(PRODUCT_FORMS)}")
        form = form if available.get(form) else "plain"
        in_layers = {id(m) for m in self.layers.modules()}
        for module in list(self.modules()):
            for name, child in module.named_children():
                if isinstance(child, PackedLinear):
                    child = child.plain()
                    setattr(module, name, child)
                if form != "plain" and type(child) is nn.Linear and id(child) not in in_layers:
                    setattr(module, name, PackedLinear(child, form))
        plain = form == "plain"
        self._layer_products = None if plain else [LayerProducts(layer, form) for layer in self.layers]
        self._packed_lm = None if plain else PRODUCT_FORMS[form](self.lm_weight(self.fc.weight.dtype))
        return self

    def confidence_logits(self, h, prev_ids) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        prev = self.markov_head.prev_embedding(prev_ids) if self.config.confidence_head_with_markov else None
        return self.confidence_head(h, prev)

    def block_input(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[..., γ] ids: the anchor followed by γ-1 mask tokens."""
        ids = torch.full((*anchor_ids.shape, self.block_size), self.config.mask_token_id, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        return ids

    # ---- training --------------------------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> TrainOutput:
        """All blocks of a batch of sequences in one backbone pass.

        features [B, L, n*d] (target features of every position), input_ids [B, L], anchors [B, A] (positions).
        Block a's queries see context strictly before anchors[b, a] and the whole of their own block, nothing else.
        """
        batch, length = input_ids.shape
        gamma = self.block_size
        num_blocks = anchors.shape[1]
        device = input_ids.device
        ctx_pos = torch.arange(length, device=device).expand(batch, length)
        ctx_kv = self.context_kv(features, ctx_pos)

        offsets = torch.arange(gamma, device=device)
        block_ids = self.block_input(input_ids.gather(1, anchors)).flatten(1)
        block_pos = (anchors[..., None] + offsets).flatten(1)
        sees_ctx = ctx_pos[:, None, :] < anchors[:, :, None]  # [B, A, L]
        sees_ctx = sees_ctx.repeat_interleave(gamma, dim=1)
        block_of = torch.arange(num_blocks * gamma, device=device) // gamma
        sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], dim=2)[:, None]

        h = self.backbone(block_ids, block_pos, ctx_kv, mask).unflatten(1, (num_blocks, gamma))
        label_pos = (anchors[..., None] + 1 + offsets).clamp(max=length - 1)
        labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
        prev = torch.cat([input_ids.gather(1, anchors)[..., None], labels[..., :-1]], dim=-1)
        logits = self.base_logits(h)
        if self.markov_head is not None:
            logits = logits + self.markov_head.block(prev, h).float()
        return TrainOutput(logits, self.confidence_logits(h, prev), labels)

    # ---- inference -------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int) -> DraftCache:
        attn = self.layers[0].self_attn
        return DraftCache(
            len(self.layers),
            batch_size,
            self.target_config.num_key_value_heads,
            attn.head_dim,
            self.fc.weight.dtype,
            self.lm_head_weight.device,
        )

    @torch.no_grad()
    def extend_context(self, cache: DraftCache, features: torch.Tensor, num_new: torch.Tensor, next_ids=None) -> None:
        """Append the target features of newly accepted tokens ([B, n, F], first num_new[b] real) to the context.
        next_ids [B, n] (the token after each new position) is for drafters that read it (EAGLE); DSpark does not.
        The cache holds accepted tokens only: each row's length grows by exactly num_new[b]."""
        slots = cache.open(features.shape[1])
        for i, (k, v) in enumerate(self.context_kv(features, slots.positions)):
            cache.write(i, k, v, slots)
        cache.advance(num_new)

    @torch.no_grad()
    def propose(
        self,
        cache: DraftCache,
        anchor_ids: torch.Tensor,
        sampling: Sampling,
        generators: list[torch.Generator] | None = None,
    ) -> Proposal:
        """Draft γ tokens after each anchor [B]: one backbone pass, then the sequential head left to right."""
        batch, gamma = anchor_ids.shape[0], self.block_size
        positions = cache.positions(gamma)
        upto = int(cache.lengths.max())
        mask = None  # rows of one length see their whole context and their whole block
        if cache.common_length() is None:
            ctx_live = cache.filled(upto)[:, None, :].expand(-1, gamma, -1)
            mask = torch.cat([ctx_live, ctx_live.new_ones(batch, gamma, gamma)], dim=2)[:, None]
        ctx_kv = [cache.view(i, upto) for i in range(len(self.layers))]
        h = self.backbone(self.block_input(anchor_ids), positions, ctx_kv, mask)
        base = self.base_logits(h)

        prev = anchor_ids
        state = self.markov_head.initial_state(h[:, 0]) if self.markov_head is not None else None
        tokens, probs = [], []
        for k in range(gamma):
            logits = base[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(prev, h[:, k], state)
                logits = logits + bias.float()
            prev = self.draw(logits, sampling, generators, probs)
            tokens.append(prev)
        drafts = torch.stack(tokens, dim=1)
        # c_k reads the token drafted at k-1 (the anchor for k = 1): all positions in one call once the block is drafted
        conf = self.confidence_logits(h, torch.cat([anchor_ids[:, None], drafts[:, :-1]], dim=1))
        return Proposal(drafts, self.full_vocab_probs(probs), conf)

    def draw(self, logits: torch.Tensor, sampling: Sampling, generators, probs: list) -> torch.Tensor:
        """One draft token per row (target ids): argmax, or a sample whose distribution is appended to `probs`."""
        if all_greedy(sampling):
            draft = logits.argmax(-1)
        else:
            p = rows_to_probs(logits, sampling)
            draft = sample_rows(p, generators)
            probs.append(p)
        return draft if self.d2t is None else self.d2t[draft]

    def full_vocab_probs(self, probs: list[torch.Tensor]) -> torch.Tensor | None:
        """Per-position draft distributions [B, γ, V] over the target's vocabulary (None when greedy)."""
        if not probs:
            return None
        stacked = torch.stack(probs, dim=1)
        if self.d2t is None:
            return stacked
        return stacked.new_zeros(*stacked.shape[:2], self.lm_head_weight.shape[0]).index_copy_(2, self.d2t, stacked)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def save(self, path: str | Path, target_identity: dict, extra: dict | None = None, dtype=None) -> None:
        """A folder with config.json and model.safetensors (trainable weights only), written atomically."""
        with atomic_dir(path) as tmp:
            self.write_files(tmp, target_identity, extra, dtype)

    def write_files(self, folder: Path, target_identity: dict, extra: dict | None = None, dtype=None) -> None:
        """config.json and model.safetensors into an existing folder (`save` makes that atomic)."""
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        meta = {
            "format": CHECKPOINT_FORMAT,
            "format_version": FORMAT_VERSION,
            "drafter": self.config.to_dict(),
            "target": target_identity,
        }
        meta.update(extra or {})
        # The weights file repeats the config fields that shape them, so a config edited apart from its weights
        # (or weights copied from another checkpoint) is caught on load.
        echo = {f"dspark.{k}": json.dumps(getattr(self.config, k)) for k in WEIGHT_SHAPING_FIELDS}
        save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt", **echo})
        (Path(folder) / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
