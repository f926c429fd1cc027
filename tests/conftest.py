"""Shared fixtures: tiny random Llama targets for mechanics, the real SmolLM2 target for the few real-model tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.drafter import DSparkConfig, DSparkDrafter
from dspark.target import Target



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
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=eos, bos_token_id=1,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    return Target(model, TinyTokenizer(vocab_size, eos), name=f"tiny-{vocab_size}-{seed}", layer_ids=[0, layers - 2])


def tiny_drafter(target: Target, seed=1, **overrides) -> DSparkDrafter:
    torch.manual_seed(seed)
    fields = dict(block_size=5, num_draft_layers=1, markov_rank=8, mask_token_id=target.vocab_size - 1, num_anchors=8)
    fields.update(overrides)
    drafter = DSparkDrafter.for_target(target, DSparkConfig(**fields))
    with torch.no_grad():  # random, non-zero everywhere, so every head actually changes the logits
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    return drafter.eval()


@pytest.fixture
def target():
    return tiny_target()


@pytest.fixture(scope="session")
def real_target():
    return Target.load("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny peaked random target saved as a real HF folder, and data it regenerated itself (as in real use)."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
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
    hf_tok.chat_template = "{% for m in messages %}t1 {{ m['content'] }} t3 {% endfor %}{% if add_generation_prompt %}t1 {% endif %}"
    hf_tok.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [{"id": f"x{i}", "messages": [{"role": "user", "content": " ".join(
        f"t{int(x)}" for x in torch.randint(5, 60, (6,), generator=g))}]} for i in range(40)]
    data = tmp / "train.jsonl"
    regenerate(Target.load(str(folder)), prompts, data, max_new_tokens=30, batch_size=8, progress=False)
    return folder, data
