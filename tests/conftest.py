"""Shared fixtures: tiny random Llama targets for mechanics, the real SmolLM2 target for the few real-model tests."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafter import DSparkConfig, DSparkDrafter, new_drafter
from dspark.products import float16_available
from dspark.target import Target


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs the suite in worker processes) the cores are shared out among the
    workers, their subprocesses included: two workers each spinning every core's thread run many times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


needs_fbgemm = pytest.mark.skipif(not float16_available(), reason="FBGEMM's float16 products are x86-only")


class TinyTokenizer:
    """Just what Target needs from a tokenizer: ids are their own text."""

    chat_template = None
    bos_token_id, pad_token_id, unk_token_id = 1, None, None

    def __init__(self, vocab_size: int, eos: int):
        self.vocab_size, self.eos_token_id = vocab_size, eos

    def __len__(self):
        return self.vocab_size

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab_size)}

    def get_added_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def tiny_target(vocab_size=97, layers=4, hidden=32, eos=5, seed=0, dtype=torch.float32) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=eos,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    return Target(model, TinyTokenizer(vocab_size, eos), name=f"tiny-{vocab_size}-{seed}", layer_ids=[0, layers - 2])


def tiny_family_target(family: str, seed=0, **extra) -> Target:
    """A tiny random target of any supported family (vocabulary 97, eos 7, layers 0 and 2 captured)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        family,
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        eos_token_id=7,
        max_position_embeddings=512,
        **extra,
    )
    return Target(
        AutoModelForCausalLM.from_config(config).eval(), TinyTokenizer(97, 7), name=f"tiny-{family}", layer_ids=[0, 2]
    )


def tiny_drafter(target: Target, seed=1, **overrides) -> DSparkDrafter:
    torch.manual_seed(seed)
    fields = dict(block_size=5, num_draft_layers=1, markov_rank=8, mask_token_id=target.vocab_size - 1, num_anchors=8)
    fields.update(overrides)
    drafter = new_drafter(target, DSparkConfig(**fields))
    with torch.no_grad():  # random, non-zero everywhere, so every head actually changes the logits
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    return drafter.eval()


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Every test's tuning records go into a cache of this session, never the user's (a subprocess inherits it); the
    converted target and inductor's compiled kernels, pure functions of their inputs, are shared with the user's
    cache, so that a machine converts and compiles them once rather than in every run."""
    from dspark.models import cache_dir

    user = cache_dir()
    cache = tmp_path_factory.mktemp("dspark-cache")
    for shared in ("targets", "inductor"):
        (user / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(user / shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSPARK_CACHE", str(cache))
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(user / "inductor"))
        yield cache


@pytest.fixture
def target():
    return tiny_target()


@pytest.fixture(scope="session")
def real_target():
    return Target.load("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="module")
def real_targets():
    """The real target in a precision (target.PRECISIONS), loaded once per module: tests that share one set every
    form they depend on."""
    from dspark.target import load_precision

    loaded: dict[str, Target] = {}

    def get(precision: str) -> Target:
        if precision not in loaded:
            loaded[precision] = load_precision("smollm2-135m-instruct", precision)
        return loaded[precision]

    return get


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny peaked random target saved as a real HF folder, and data it regenerated itself (as in real use)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    from dspark.target import Target
    from dspark.training.regenerate import regenerate

    tmp = tmp_path_factory.mktemp("tiny")
    target = tiny_target(vocab_size=64, layers=4, hidden=32, eos=2)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(8)  # peaked, so there is something to imitate
    folder = tmp / "tiny-target"
    target.model.save_pretrained(folder)
    tk = Tokenizer(tk_models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t2", bos_token="t1", unk_token="t0")
    hf_tok.chat_template = (
        "{% for m in messages %}t1 {{ m['content'] }} t3 {% endfor %}{% if add_generation_prompt %}t1 {% endif %}"
    )
    hf_tok.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {
            "id": f"x{i}",
            "messages": [
                {"role": "user", "content": " ".join(f"t{int(x)}" for x in torch.randint(5, 60, (6,), generator=g))}
            ],
        }
        for i in range(40)
    ]
    data = tmp / "train.jsonl"
    regenerate(Target.load(str(folder)), prompts, data, max_new_tokens=30, batch_size=8, progress=False)
    return folder, data


class NoisyOracle:
    """A proposer that knows the target, so that most drafts are accepted and every verification path runs.

    Greedy: it drafts the target's own next tokens, each replaced by a random token with probability `noise` (at
    random, per row and position). Sampling: it samples each draft from (1 - noise)·q + noise·uniform, q the target's
    processed distribution given the drafts so far, and reports exactly that mixture. Confidence logits depend on
    the drafted tokens (high after a draft that equals the target's argmax), as a real confidence head's do: that
    dependence is what the scheduler's early stop must not leak into the output.

    The engine must be given the prompts this oracle was built with, in the same order (rows are matched to
    prompts in the order they are admitted; an empty cache starts a new batch)."""

    def __init__(self, target, prompts, block_size=5, noise=0.3, seed=0):
        self.target, self.prompts, self.block_size, self.noise = target, prompts, block_size, noise
        self.target_layer_ids = [0]
        self.generator = torch.Generator().manual_seed(seed)

    def eval(self):
        return self

    def new_cache(self, batch_size):
        if batch_size == 0:
            self.admitted = 0
        rows = self.prompts[self.admitted : self.admitted + batch_size]
        assert len(rows) == batch_size
        self.admitted += batch_size
        return OracleCache([list(p[:1]) for p in rows])

    def extend_context(self, cache, features, num_new, next_ids):
        for b, n in enumerate(num_new.tolist()):
            cache.histories[b].extend(next_ids[b, :n].tolist())

    def propose(self, cache, anchor_ids, sampling, generators=None):
        from dspark.decoding.requests import pad_prompts
        from dspark.proposer import Proposal
        from dspark.sampling import all_greedy, rows_to_probs, sample_rows

        seqs = [list(h) for h in cache.histories]
        assert [s[-1] for s in seqs] == anchor_ids.tolist()
        batch, vocab = len(seqs), self.target.vocab_size
        tokens, probs, conf = [], [], []
        hit = torch.ones(batch, dtype=torch.bool)
        for _ in range(self.block_size):
            ids, lengths = pad_prompts(seqs, "cpu")
            logits = self.target.forward_sequences(ids, lengths).logits[torch.arange(batch), lengths - 1]
            conf.append(torch.where(hit, 2.0, -1.0) + 0.5 * torch.randn(batch, generator=self.generator))
            if all_greedy(sampling):
                draft = logits.argmax(-1)
                noisy = torch.rand(batch, generator=self.generator) < self.noise
                draft = torch.where(noisy, torch.randint(0, vocab, (batch,), generator=self.generator), draft)
            else:
                p = (1 - self.noise) * rows_to_probs(logits, sampling) + self.noise / vocab
                draft = sample_rows(p, generators)
                probs.append(p)
            hit = draft == logits.argmax(-1)
            tokens.append(draft)
            for s, t in zip(seqs, draft.tolist()):
                s.append(t)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, torch.stack(conf, 1))


class OracleCache:
    def __init__(self, histories):
        self.histories = histories

    def select(self, rows):
        self.histories = [self.histories[i] for i in rows.tolist()]

    def merge(self, other):
        self.histories += other.histories


def run_cli_output(capsys, *args) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `dspark ARGS`, run in this process; argparse's own refusals exit 2 as well."""
    from dspark.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def run_cli(capsys, *args) -> tuple[int, str]:
    """Exit code and stderr of `dspark ARGS`."""
    code, _, err = run_cli_output(capsys, *args)
    return code, err


def refused(capsys, message, *args):
    code, err = run_cli(capsys, *args)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


@pytest.fixture
def saved_drafter(tmp_path):
    """A tiny target saved as a real model folder and a drafter checkpoint with its calibration and model card."""
    target = tiny_target(vocab_size=64, eos=2)
    folder = tmp_path / "target"
    target.model.save_pretrained(folder)
    from tokenizers import Tokenizer
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    tk = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tk_models.WordLevel({f"t{i}": i for i in range(64)}, "t0")),
        eos_token="t2",
        unk_token="t0",
    )
    tk.save_pretrained(folder)
    from dspark.target import Target

    target = Target.load(str(folder))
    ckpt = tmp_path / "drafter"
    tiny_drafter(target, mask_token_id=63).save(ckpt, target.identity())
    (ckpt / "calibration.json").write_text(json.dumps({"sts_temperatures": [1.0] * 5}))
    (ckpt / "MODEL_CARD.md").write_text("# card\n")
    return folder, ckpt, target


def decode_plain_and_speculative(target):
    """Three prompts decoded greedily by plain decoding (their token ids) and by the speculative engine under a noisy
    oracle that gets most drafts accepted (its results)."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain

    prompts = [[3, 9, 14], [5], [20, 21, 22, 23, 24]]
    expected = [r.token_ids for r in generate_plain(target, prompts, 30)]
    engine = SpeculativeEngine(target, NoisyOracle(target, prompts, block_size=4, noise=0.2))
    return expected, engine.generate(prompts, 30)
