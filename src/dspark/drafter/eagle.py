"""EAGLE-3-style baseline drafter (docs/design.md §6): autoregressive, one decoder layer over fused target features.

At context position t the input is W[f_t ; e(x_{t+1})], f_t the fused target feature; the layer's output h_t
predicts x_{t+2}. Drafting feeds the drafter's own output back as the feature: W[h_t ; e(x̂_{t+2})] at position
t+1, and so on, one forward per draft token. Training uses "training-time test": the chain is unrolled for
`block_size` steps; step j at position t sees the real context up to its chain's start t-j and its own earlier
steps, and its loss weighs decay^(j) (the trainer's position weights). With block_size 1 this is an MTP-1 module.

It shares the DSpark drafter's interface (forward over anchors / extend_context / propose / save / load).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.drafter.backbone import layer_forward
from dspark.drafter.model import DraftCache, DSparkDrafter, TrainOutput
from dspark.proposer import Proposal
from dspark.sampling import Sampling


class EagleDrafter(DSparkDrafter):
    def __init__(self, config, target_config, embed_weight, lm_head_weight):
        super().__init__(config, target_config, embed_weight, lm_head_weight)
        hidden = lm_head_weight.shape[1]
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        nn.init.normal_(self.input_proj.weight, std=getattr(target_config, "initializer_range", 0.02))

    def _layer(self, x, positions, past_k, past_v, mask):
        """x [B, Q, d] at positions [B, Q]; keys/values = cat(past, own); mask [B, 1, Q, past + Q]."""
        cos, sin = self.rotary_emb(x, positions)
        layer, products = self.layers_for_inference()[0]
        return layer_forward(layer, x, cos, sin, past_k, past_v, mask, products)

    def _inputs(self, feature, next_ids):
        emb = nn.functional.embedding(next_ids, self.embed_weight).to(feature.dtype)
        return self.input_proj(torch.cat([feature, emb], dim=-1))

    # ---- training: training-time test ----------------------------------------------------------------------------
    def forward(self, features, input_ids, anchors) -> TrainOutput:
        """Draft position k (0-based) of the block at anchor a is step k at position t = a + k - 1."""
        batch, length = input_ids.shape
        device = input_ids.device
        gamma = self.block_size
        t = torch.arange(length, device=device)
        positions = t.expand(batch, length)
        next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        feature = self.fuse(features)
        keys, values, steps = [], [], []
        for j in range(gamma):
            # Step j at t sees real entries s <= t - j and its chain's step i at position t - (j - i), 1 <= i <= j.
            visible = [t[None, :] <= t[:, None] - j] + [t[None, :] == t[:, None] - (j - i) for i in range(1, j + 1)]
            mask = torch.cat(visible, dim=1)[None, None]
            past_k = torch.cat(keys, dim=2) if keys else None
            past_v = torch.cat(values, dim=2) if values else None
            h, k, v = self._layer(self._inputs(feature, next_ids), positions, past_k, past_v, mask)
            keys.append(k)
            values.append(v)
            steps.append(h)
            feature = torch.cat([h[:, :1], h[:, :-1]], dim=1)  # step j+1 at t continues step j's chain at t-1
        hidden = torch.stack(steps, dim=2)  # [B, L, γ, d]
        k = torch.arange(gamma, device=device)
        at = (anchors[..., None] + k - 1).clamp(0, length - 1)  # [B, A, γ]
        rows = torch.arange(batch, device=device)[:, None, None]
        h = self.norm(hidden[rows, at, k])
        label_pos = (anchors[..., None] + 1 + k).clamp(max=length - 1)
        labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
        return TrainOutput(self.base_logits(h), None, labels)

    # ---- inference ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def extend_context(self, cache: DraftCache, features, num_new, next_ids=None) -> None:
        """Append real entries [f_t ; e(x_{t+1})] for the new positions; keep each row's last output, which
        proposes the first draft token of the next round."""
        width, upto = features.shape[1], int(cache.lengths.max())
        slots = cache.open(width)
        positions = slots.positions
        past_k, past_v = cache.view(0, upto)
        own = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril()
        mask = torch.cat([cache.filled(upto)[:, None, :].expand(-1, width, -1), own.expand(len(positions), -1, -1)], 2)
        h, k, v = self._layer(self._inputs(self.fuse(features), next_ids), positions, past_k, past_v, mask[:, None])
        cache.write(0, k, v, slots)
        cache.advance(num_new)
        cache.row_state["last"] = h[torch.arange(h.shape[0]), (num_new - 1).clamp_min(0)]

    @torch.no_grad()
    def propose(self, cache: DraftCache, anchor_ids, sampling: Sampling, generators=None) -> Proposal:
        h = cache.row_state["last"]
        upto = int(cache.lengths.max())
        keys, values = cache.view(0, upto)
        live = cache.filled(upto)
        position = cache.lengths - 1  # the last context entry starts the chain
        tokens, probs, own_k, own_v = [], [], [], []
        for step in range(self.block_size):
            draft = self.draw(self.base_logits(self.norm(h)), sampling, generators, probs)
            tokens.append(draft)
            if step == self.block_size - 1:
                break
            position = position + 1
            mask = torch.cat([live, live.new_ones(live.shape[0], len(own_k) + 1)], dim=1)[:, None, None]
            out, k, v = self._layer(
                self._inputs(h, draft)[:, None],
                position[:, None],
                torch.cat([keys, *own_k], dim=2),
                torch.cat([values, *own_v], dim=2),
                mask,
            )
            own_k.append(k)
            own_v.append(v)
            h = out[:, 0]
        return Proposal(torch.stack(tokens, dim=1), self.full_vocab_probs(probs), None)
