"""Where a drafter starts: a new one (target layers, draft vocabulary, Markov head from bigrams) or a continued one
(ported, deepened, widened), and its optimizer groups."""

from __future__ import annotations

import logging

import torch

from dspark.drafter import lineage, load_drafter, new_drafter, port_to_qwen3, read_checkpoint_meta
from dspark.errors import DSparkError
from dspark.records import Example
from dspark.training.config import TrainConfig

log = logging.getLogger("dspark.train")


def answer_token_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        answer = torch.tensor([t for t, m in zip(e.input_ids, e.loss_mask) if m], dtype=torch.long)
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def draft_vocabulary(examples: list[Example], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent assistant tokens (sorted ids) and the share of assistant tokens they cover."""
    counts = answer_token_counts(examples, vocab_size)
    top = counts.topk(size).indices.sort().values
    return top, float(counts[top].sum() / counts.sum().clamp_min(1))


def widen_draft_vocabulary(drafter, examples: list[Example], size: int, vocab_size: int) -> tuple[float, float]:
    """`--draft-vocab-size` on a continued drafter: add the most frequent answer tokens it lacks until it has `size`
    (a vocabulary chosen from early data can miss much of later data: the shipped drafter's 8,192 tokens, taken from a
    math-and-code set, missed 10 % of the tokens of assistant answers). Returns the share of answer tokens covered
    before and after."""
    have = drafter.draft_vocab_size
    if drafter.d2t is None or size < have:
        raise DSparkError(
            f"--draft-vocab-size {size}: the drafter being continued scores {have} tokens, and a "
            "vocabulary can only grow (its Markov rows are learned); pass a size >= it, or 0 to keep it"
        )
    counts = answer_token_counts(examples, vocab_size)
    covered = lambda: float(counts[drafter.d2t].sum() / counts.sum().clamp_min(1))
    before = covered()
    missing = counts.clone()
    missing[drafter.d2t] = -1
    drafter.widen_draft_vocab(torch.sort(missing, descending=True, stable=True).indices[: size - have])
    return before, covered()


def init_markov_from_bigrams(drafter, examples: list[Example], max_rows: int = 8192, smoothing: float = 0.5) -> float:
    """Start the Markov head at a rank-r factorisation of the bigram log-probabilities of the answers: B(prev) ≈
    log P(next | prev) − mean over next, for the `max_rows` most frequent previous tokens (the others start at zero).
    Identical on every DDP rank (same data, deterministic SVD). Returns the share of the centred matrix's energy kept."""
    head = drafter.markov_head
    vocab, rank = head.markov_w1.num_embeddings, drafter.config.markov_rank
    t2d = drafter.t2d()
    pairs = []
    for e in examples:
        ids, mask = torch.tensor(e.input_ids), torch.tensor(e.loss_mask, dtype=torch.bool)
        inside = mask[:-1] & mask[1:]  # both are answer tokens, as an anchor and its next token are
        pairs.append(torch.stack([ids[:-1][inside], ids[1:][inside]]))
    prev, nxt = torch.cat(pairs, dim=1)
    if t2d is not None:
        nxt = t2d[nxt]
        prev, nxt = prev[nxt >= 0], nxt[nxt >= 0]
    draft = drafter.draft_vocab_size
    rows = torch.bincount(prev, minlength=vocab).topk(min(max_rows, vocab)).indices
    row_of = torch.full((vocab,), -1, dtype=torch.long)
    row_of[rows] = torch.arange(len(rows))
    keep = row_of[prev] >= 0
    counts = torch.zeros(len(rows), draft)
    counts.index_put_((row_of[prev[keep]], nxt[keep]), torch.ones(int(keep.sum())), accumulate=True)
    logp = (counts + smoothing).log() - (counts.sum(1, keepdim=True) + smoothing * draft).log()
    centred = logp - logp.mean(1, keepdim=True)
    u, s, v = torch.svd_lowrank(centred, q=min(rank, *centred.shape), niter=4)
    pad = rank - len(s)  # a matrix of lower rank than the head: the remaining directions start at zero
    u, v = torch.nn.functional.pad(u, (0, pad)), torch.nn.functional.pad(v, (0, pad))
    s = torch.nn.functional.pad(s, (0, pad))
    with torch.no_grad():
        head.markov_w1.weight.zero_()
        head.markov_w1.weight[rows] = (u * s.sqrt()).to(head.markov_w1.weight.dtype)
        head.markov_w2.weight.copy_(v * s.sqrt())
    return float(s.pow(2).sum() / centred.pow(2).sum())


def param_groups(drafter, cfg: TrainConfig) -> list[dict]:
    """AdamW groups. Weight decay pulls matrices toward zero; norms (toward zero = off) and biases get none. With
    --copied-lr-scale, the layers copied from the target (already good features) move at a scaled rate; layers added
    by --add-draft-layers start as identities and learn at the full rate."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    copied_layers = [f"layers.{i}." for i in range(len(drafter.layers) - cfg.add_draft_layers)]

    def copied(name):  # one group for all when the scale is 1, as checkpoints from before the flag have
        return cfg.copied_lr_scale != 1.0 and name.startswith(("norm.", *copied_layers))

    groups = []
    for scale, members in (
        (1.0, [(n, p) for n, p in named if not copied(n)]),
        (cfg.copied_lr_scale, [(n, p) for n, p in named if copied(n)]),
    ):
        for decay, params in (
            (cfg.weight_decay, [p for _, p in members if p.ndim >= 2]),
            (0.0, [p for _, p in members if p.ndim < 2]),
        ):
            if params:
                groups.append({"params": params, "weight_decay": decay, "lr_scale": scale})
    return groups


def build_drafter(cfg: TrainConfig, target, train_set: list[Example]):
    """The drafter this run trains, and the legs it continues: `--init-from` continued (ported to the portable
    backbone, deepened, its Markov rank and draft vocabulary widened, as asked), else a new one (from the target's
    top layers, with a draft vocabulary of the most frequent answer tokens and the Markov head from the data's
    bigrams, as asked)."""
    ancestors = []  # the legs this run continues (`--init-from`), kept in every checkpoint
    if cfg.init_from:
        ancestors = lineage(read_checkpoint_meta(cfg.init_from))
        drafter = load_drafter(cfg.init_from, target).float()
        drafter.config.num_anchors = cfg.num_anchors
        if drafter.config.backbone != cfg.backbone == "qwen3":
            drafter = port_to_qwen3(drafter, target)
            log.info(
                f"{cfg.init_from} has the target-family backbone; continuing it on the portable qwen3 "
                "backbone (q/k norms start at one; --backbone family keeps the family layers)"
            )
        if cfg.add_draft_layers:
            drafter.add_layers(cfg.add_draft_layers, target.model if cfg.init_target_layers else None)
            log.info(
                f"{cfg.init_from} deepened to {len(drafter.layers)} draft layers (the new ones start as identities)"
            )
        if cfg.widen_markov_rank and cfg.widen_markov_rank != drafter.config.markov_rank:
            narrower = drafter.config.markov_rank
            drafter.widen_markov_rank(cfg.widen_markov_rank)
            log.info(
                f"{cfg.init_from}: Markov head widened from rank {narrower} to {cfg.widen_markov_rank} (the new "
                "dimensions start with no effect on the logits or the confidences)"
            )
        if cfg.draft_vocab_size and cfg.draft_vocab_size != drafter.draft_vocab_size:
            before, after = widen_draft_vocabulary(drafter, train_set, cfg.draft_vocab_size, target.vocab_size)
            log.info(
                f"draft vocabulary widened to {cfg.draft_vocab_size} tokens: it covered {before:.1%} of "
                f"the answer tokens, now {after:.1%} (new tokens start with no Markov bias)"
            )
    else:
        drafter = new_drafter(target, cfg.drafter_config()).float()
        if cfg.init_target_layers:
            drafter.init_from_target_layers(target.model)
        if cfg.draft_vocab_size:
            d2t, coverage = draft_vocabulary(train_set, cfg.draft_vocab_size, target.vocab_size)
            drafter.set_draft_vocab(d2t)
            log.info(f"draft vocabulary of {cfg.draft_vocab_size} covers {coverage:.1%} of answer tokens")
        if cfg.markov_init == "bigram" and drafter.markov_head is not None:
            if drafter.config.markov_head_type != "vanilla":
                raise DSparkError(
                    "--markov-init bigram sets B(prev) = W2·W1[prev], the vanilla head's formula; use "
                    "--markov-head-type vanilla or --markov-init zero"
                )
            explained = init_markov_from_bigrams(drafter, train_set)
            log.info(
                f"Markov head starts from the data's bigrams (rank {drafter.config.markov_rank} keeps "
                f"{explained:.1%} of their centred log-probabilities)"
            )
    return drafter, ancestors
