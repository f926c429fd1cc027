"""Sequential heads (Markov vanilla / gated, RNN) and the confidence head (docs/design.md §2.4, §2.5).

A sequential head adds a bias B_k to the backbone's logits U_k from the token at k-1 (sampled at inference, the
ground truth in training). `step` is one position (inference, left to right); `block` is all γ positions of many
blocks at once under teacher forcing, and must equal γ calls of `step`.
"""

from __future__ import annotations

import torch
from torch import nn


class VanillaMarkovHead(nn.Module):
    """B_k = W2(W1[x_{k-1}])."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, draft_vocab_size: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)

    def initial_state(self, h: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, prev_ids, h, state):
        """prev_ids [...], h [..., d] -> (bias [..., Vd], next state)."""
        return self.markov_w2(self.prev_embedding(prev_ids)), state

    def block(self, prev_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """prev_ids [..., γ], h [..., γ, d] -> bias [..., γ, Vd]; memoryless heads do all positions at once."""
        return self.step(prev_ids, h, None)[0]


class GatedMarkovHead(VanillaMarkovHead):
    """B_k = W2(σ(G[h_k; W1[x_{k-1}]]) ⊙ W1[x_{k-1}])."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, draft_vocab_size: int):
        super().__init__(vocab_size, rank, hidden_size, draft_vocab_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, prev_ids, h, state):
        e = self.prev_embedding(prev_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, e.to(h.dtype)], dim=-1)))
        return self.markov_w2(gate.to(e.dtype) * e), state


class RNNHead(VanillaMarkovHead):
    """z_k = [s_{k-1}; W1[x_{k-1}]; h_k] -> (g, c, o); s_k = σ(g)s_{k-1} + (1-σ(g))tanh(c); B_k = W2 tanh(o)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, draft_vocab_size: int):
        super().__init__(vocab_size, rank, hidden_size, draft_vocab_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, h: torch.Tensor) -> torch.Tensor:
        return h.new_zeros(*h.shape[:-1], self.rank)

    def step(self, prev_ids, h, state):
        e = self.prev_embedding(prev_ids).to(h.dtype)
        g, c, o = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        state = gate * state + (1 - gate) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), state

    def block(self, prev_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        state = self.initial_state(h[..., 0, :])
        biases = []
        for k in range(prev_ids.shape[-1]):
            bias, state = self.step(prev_ids[..., k], h[..., k, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


MARKOV_HEADS = {"vanilla": VanillaMarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


class ConfidenceHead(nn.Module):
    """c_k = σ(w·[h_k; W1[x_{k-1}]] + b): P(position k accepted | positions before it accepted). Returns logits."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, h: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        if prev_embedding is not None:
            h = torch.cat([h, prev_embedding.to(h.dtype)], dim=-1)
        return self.proj(h).squeeze(-1).float()
