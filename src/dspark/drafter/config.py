"""DSparkConfig: every knob of the drafter (docs/design.md §2), validated against the target it drafts for."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from dspark.errors import DSparkError

HEAD_TYPES = ("vanilla", "gated", "rnn")
ARCHITECTURES = ("dspark", "eagle3")
BACKBONES = ("family", "qwen3")


@dataclass
class DSparkConfig:
    architecture: str = (
        "dspark"  # dspark (parallel block + heads) | eagle3 (autoregressive baseline, docs/design.md §6)
    )
    block_size: int = 7  # γ: draft positions per block, the anchor slot included
    num_draft_layers: int = 5
    target_layer_ids: list[int] = field(default_factory=list)  # decoder layers whose outputs feed the drafter
    mask_token_id: int = -1  # filled from the target when left at -1
    markov_rank: int = 256  # r; 0 disables the sequential head (pure parallel, DFlash)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # confidence sees W1[x_{k-1}] beside h_k
    num_anchors: int = 512  # blocks sampled per training sequence
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary; else a frequent subset (d2t map)
    feature_norm: bool = False  # RMS-normalise each captured layer before fc (tames massive activations)
    backbone: str = "qwen3"  # qwen3: portable Qwen3-style layers for any target | family: the target's own layers

    def validate(self, num_target_layers: int, vocab_size: int) -> None:
        def bad(name, why):
            raise DSparkError(f"DSparkConfig.{name}: {why}")

        if self.block_size < 1:
            bad("block_size", f"must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            bad("num_draft_layers", f"must be >= 1, got {self.num_draft_layers}")
        if self.markov_rank < 0:
            bad("markov_rank", f"must be >= 0 (0 disables the sequential head), got {self.markov_rank}")
        if self.markov_head_type not in HEAD_TYPES:
            bad("markov_head_type", f"unknown head type '{self.markov_head_type}'; use one of {', '.join(HEAD_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            bad("confidence_head_with_markov", "needs markov_rank > 0 (there is no Markov embedding at rank 0)")
        if not self.target_layer_ids:
            bad("target_layer_ids", "must name at least one target decoder layer")
        for i in self.target_layer_ids:
            if not 0 <= i < num_target_layers - 1:
                bad(
                    "target_layer_ids",
                    f"{i} is outside [0, {num_target_layers - 2}] (target has {num_target_layers} layers; "
                    "its last layer is never a feature)",
                )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            bad("target_layer_ids", f"repeats a layer: {self.target_layer_ids}")
        if not 0 <= self.mask_token_id < vocab_size:
            bad("mask_token_id", f"{self.mask_token_id} is outside the target vocabulary [0, {vocab_size})")
        if self.num_anchors < 1:
            bad("num_anchors", f"must be >= 1, got {self.num_anchors}")
        if self.architecture not in ARCHITECTURES:
            bad("architecture", f"unknown architecture '{self.architecture}'; use one of {', '.join(ARCHITECTURES)}")
        if self.architecture == "eagle3":
            if self.num_draft_layers != 1:
                bad("num_draft_layers", "the eagle3 baseline has exactly one decoder layer")
            if self.markov_rank or self.enable_confidence_head:
                bad("markov_rank", "the eagle3 baseline has no sequential or confidence head (rank 0, no confidence)")
        if self.backbone not in BACKBONES:
            bad("backbone", f"unknown backbone '{self.backbone}'; use one of {', '.join(BACKBONES)}")
        if not 0 <= self.draft_vocab_size <= vocab_size:
            bad("draft_vocab_size", f"must be in [0, {vocab_size}] (0 = full vocabulary), got {self.draft_vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "drafter config") -> DSparkConfig:
        """A config from JSON data, every field checked for its type (a hand-edited file must not load half-wrong)."""
        if "backbone" not in data:  # written before the field existed, when every drafter used the target's family
            data = dict(data, backbone="family")
        known = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise DSparkError(
                f"{where}: unknown drafter config fields {sorted(unknown)}; known fields: {sorted(known)}"
            )
        for name, value in data.items():
            kind = type(getattr(cls(), name))
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if kind is list:
                ok = isinstance(value, list) and all(type(v) is int for v in value)
            if not ok:
                want = "a list of integers" if kind is list else kind.__name__
                raise DSparkError(f"{where}: field {name} must be {want}, got {value!r}")
        return cls(**data)
