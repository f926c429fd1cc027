"""Interop formats: speculators (vLLM), DeepSpec and GGUF (llama.cpp). Round trips give identical proposals; every
field that other runtimes index differently (layer ids + 1, d2t offsets, the anchor convention) is checked by value;
what a format cannot express is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import refused, run_cli, tiny_drafter, tiny_target
from dspark.errors import DSparkError
from dspark.formats import detect, export_foreign, import_foreign
from dspark.sampling import SamplingParams


def proposals(drafter, target, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy drafts and confidences after each prompt, the drafter reading the target's real features."""
    out = []
    for ids in prompts:
        ids = torch.tensor([ids])
        feats = target.forward_sequences(ids, features=list(drafter.target_layer_ids)).features
        cache = drafter.new_cache(1)
        drafter.extend_context(cache, feats[:, :-1], torch.tensor([ids.shape[1] - 1]))
        p = drafter.propose(cache, ids[:, -1], SamplingParams())
        out.append((p.tokens[0].tolist(), p.confidence_logits[0].tolist()))
    return out


@pytest.fixture
def portable(target):
    drafter = tiny_drafter(target, backbone="qwen3", num_draft_layers=2, draft_vocab_size=50)
    drafter.set_draft_vocab(torch.randperm(97)[:50].sort().values)
    return drafter


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60]]


@pytest.mark.parametrize("fmt, draft_vocab", [("speculators", 50), ("speculators", 0), ("deepspec", 0)])
def test_round_trip_gives_identical_proposals(target, tmp_path, fmt, draft_vocab):
    drafter = tiny_drafter(target, backbone="qwen3", num_draft_layers=2, draft_vocab_size=draft_vocab)
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(97)[:draft_vocab].sort().values)
    export_foreign(drafter, target, tmp_path, fmt, torch.float32)
    assert detect(tmp_path) == fmt
    back = import_foreign(tmp_path, target)
    assert back.config.to_dict() == drafter.config.to_dict()
    assert proposals(back, target, PROMPTS) == proposals(drafter, target, PROMPTS)


def test_speculators_fields_follow_vllm_indexing(target, portable, tmp_path):
    export_foreign(portable, target, tmp_path, "speculators", torch.bfloat16)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["speculators_model_type"] == "dspark" and meta["architectures"] == ["DSparkSpeculator"]
    assert meta["aux_hidden_state_layer_ids"] == [i + 1 for i in portable.config.target_layer_ids]
    assert meta["sample_from_anchor"] is True and meta["draft_vocab_size"] == 50
    assert meta["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == portable.block_size
    layers = meta["transformer_layer_config"]
    assert layers["model_type"] == "qwen3" and layers["num_hidden_layers"] == 2
    tensors = load_file(tmp_path / "model.safetensors")
    d2t = portable.d2t
    assert torch.equal(tensors["d2t"], d2t - torch.arange(50))  # offsets, as EAGLE-3/speculators store them
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].sum() == 50 and tensors["t2d"][d2t].all()
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight[d2t].to(torch.bfloat16))
    assert "embed_tokens.weight" not in tensors and tensors["layers.1.self_attn.q_norm.weight"].dtype == torch.bfloat16


def test_deepspec_carries_the_target_embedding_and_head(target, tmp_path):
    drafter = tiny_drafter(target, backbone="qwen3")
    export_foreign(drafter, target, tmp_path, "deepspec", torch.float32)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["architectures"] == ["Qwen3DSparkModel"] and meta["tie_word_embeddings"] is False
    assert meta["target_layer_ids"] == drafter.config.target_layer_ids and meta["num_hidden_layers"] == 1
    tensors = load_file(tmp_path / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight)
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight)


def test_what_a_format_cannot_express_is_refused(target, portable, tmp_path):
    with pytest.raises(DSparkError, match="--backbone qwen3"):
        export_foreign(tiny_drafter(target, backbone="family"), target, tmp_path, "speculators", torch.float32)
    with pytest.raises(DSparkError, match="no reduced draft vocabulary"):
        export_foreign(portable, target, tmp_path, "deepspec", torch.float32)
    with pytest.raises(DSparkError, match="vanilla Markov head"):
        export_foreign(
            tiny_drafter(target, backbone="qwen3", markov_head_type="rnn"),
            target,
            tmp_path,
            "gguf",
            torch.float32,
            tmp_path / "unused.gguf",
        )


def test_import_refuses_a_bonus_anchor_drafter_and_another_target(target, portable, tmp_path):
    export_foreign(portable, target, tmp_path, "speculators", torch.float32)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(meta, sample_from_anchor=False)))
    with pytest.raises(DSparkError, match="sample_from_anchor is false"):
        import_foreign(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(DSparkError, match="hidden_size=32, but the loaded target needs 48"):
        import_foreign(tmp_path, tiny_target(hidden=48))
    with pytest.raises(DSparkError, match="lm_head.weight differs"):
        import_foreign(tmp_path, tiny_target(seed=3))


def fake_target_gguf(path, vocab_size: int):
    """A GGUF holding only a target's tokenizer metadata: all the draft export reads from it."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_eos_token_id(5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_holds_what_llama_cpp_reads(target, portable, tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "out"
    out.mkdir()
    export_foreign(portable, target, out, "gguf", torch.float16, fake_target_gguf(tmp_path / "t.gguf", 97))
    reader = GGUFReader(str(next(out.glob("*.gguf"))))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.target_layers"] == [i + 1 for i in portable.config.target_layer_ids]
    assert fields["dflash.block_size"] == portable.block_size and fields["dflash.sample_from_anchor"] is True
    assert fields["dflash.has_confidence_head"] is True and fields["dflash.block_count"] == 2
    assert fields["tokenizer.ggml.mask_token_id"] == portable.config.mask_token_id
    assert fields["tokenizer.ggml.tokens"][:3] == ["t0", "t1", "t2"] and fields["tokenizer.ggml.eos_token_id"] == 5
    tensors = {t.name: t for t in reader.tensors}
    # ggml shapes are innermost-first: markov_w1 {rank, n_vocab}, markov_w2 {rank, n_draft}, conf_proj {d + rank, 1}
    assert list(tensors["markov_w1.weight"].shape) == [8, 97] and list(tensors["markov_w2.weight"].shape) == [8, 50]
    assert list(tensors["conf_proj.weight"].shape) == [40, 1] and list(tensors["fc.weight"].shape) == [64, 32]
    assert {"blk.1.attn_q_norm.weight", "enc.output_norm.weight", "output_norm.weight", "output.weight"} <= set(tensors)
    assert np.array_equal(np.asarray(tensors["d2t"].data), portable.d2t.numpy())
    w1 = np.asarray(tensors["markov_w1.weight"].data, dtype=np.float32)
    assert np.array_equal(w1, portable.markov_head.markov_w1.weight.detach().half().float().numpy())
    assert "token_embd.weight" not in tensors  # shared with the target at run time


def test_gguf_refuses_a_target_gguf_of_another_vocabulary(target, portable, tmp_path):
    with pytest.raises(DSparkError, match="has 50 tokens, but the target has 97"):
        export_foreign(portable, target, tmp_path, "gguf", torch.float32, fake_target_gguf(tmp_path / "t.gguf", 50))


def llama_cpp_or_skip():
    from dspark.llamacpp import import_llama_cpp

    llama_cpp = import_llama_cpp()
    if llama_cpp is None:
        pytest.skip(
            "llama-cpp-python is not installed or finds no libllama (pip install llama-cpp-python, or set "
            "LLAMA_CPP_LIB_PATH to a llama.cpp build; see docs/formats.md)"
        )
    return llama_cpp


# ---- the real target ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_portable(real_target):
    """The shipped drafter: what these tests export to llama.cpp and vLLM is what users get."""
    from dspark.assets import shipped_drafter
    from dspark.drafter import load_drafter

    return load_drafter(shipped_drafter("smollm2-135m-instruct"), real_target).eval()


@pytest.mark.real
def test_speculators_round_trip_on_the_real_target(real_target, real_portable, tmp_path):
    prompts = [real_target.encode_chat(q) for q in ("What is 12 times 7?", "Write a haiku about rain.")]
    export_foreign(real_portable, real_target, tmp_path, "speculators", torch.float32)
    back = import_foreign(tmp_path, real_target)
    assert proposals(back, real_target, prompts) == proposals(real_portable, real_target, prompts)


@pytest.mark.real
def test_llama_cpp_loads_the_exported_draft(real_target, real_portable, tmp_path):
    from dspark.models import target_gguf

    export_foreign(real_portable, real_target, tmp_path, "gguf", torch.float16, target_gguf("smollm2-135m-instruct"))
    draft = next(tmp_path.glob("*.gguf"))
    llama_cpp = llama_cpp_or_skip()

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(draft).encode(), params)
    assert model, "llama.cpp refused the draft GGUF (run with verbose logs to see which tensor or key)"
    try:
        # every tensor was shape-checked on load; the draft's own parameter count is what we wrote
        written = sum(p.numel() for k, p in real_portable.state_dict().items() if k != "d2t")
        written += real_portable.lm_weight(torch.float32).numel()
        assert llama_cpp.llama_model_n_params(model) == written + real_portable.draft_vocab_size
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.slow
@pytest.mark.real
def test_float32_gguf_holds_the_weights_our_float32_target_runs(real_target, tmp_path):
    """The benchmark's float32 copy of the target's GGUF: same keys and tokenizer, every tensor dequantized to
    exactly the values transformers loads into our float32 target (so llama.cpp on it does our arithmetic)."""
    from gguf import GGUFReader

    from dspark.formats.gguf import float32_gguf, gguf_weights
    from dspark.models import target_gguf

    source = target_gguf("smollm2-135m-instruct")
    copy = float32_gguf(source, tmp_path / "t.f32.gguf")
    assert gguf_weights(source) == "Q4_1" and gguf_weights(copy) == "F32"
    before, after = GGUFReader(str(source)), GGUFReader(str(copy))
    assert {t.name for t in before.tensors} == {t.name for t in after.tensors}
    assert all(t.tensor_type.name == "F32" for t in after.tensors)
    assert after.fields["tokenizer.ggml.tokens"].contents() == before.fields["tokenizer.ggml.tokens"].contents()
    assert after.fields["llama.block_count"].contents() == 30
    tensors = {t.name: torch.from_numpy(np.asarray(t.data)) for t in after.tensors}
    weights = real_target.model.state_dict()
    assert torch.equal(tensors["blk.3.ffn_down.weight"], weights["model.layers.3.mlp.down_proj.weight"])  # Q4_1
    assert torch.equal(tensors["token_embd.weight"], weights["model.embed_tokens.weight"])  # Q8_0
    assert not (tmp_path / "t.f32.gguf.partial").exists()


@pytest.mark.real
def test_llama_cpp_regenerates_the_targets_answers(real_target, tmp_path):
    """`regenerate --backend llama-cpp`: the target's GGUF answers in llama.cpp, turn by turn; records say so. llama.cpp
    computes with the quantized weights (and 8-bit activations), so its greedy answers may part from the float
    target's at a near-tie, even at the first token; what must hold is that every token it chose is one the float
    target ranks among its top few there (a wrong prompt, template or tokenizer would break that at once)."""
    llama_cpp_or_skip()
    from dspark.models import target_gguf
    from dspark.training.llama_backend import load_llama
    from dspark.training.regenerate import regenerate

    records = [
        {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {
            "id": "b",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "Name a color."},
            ],
        },
    ]
    llm = load_llama(target_gguf("smollm2-135m-instruct"), real_target, threads=2)
    regenerate(real_target, records, tmp_path / "llama.jsonl", max_new_tokens=12, progress=False, llm=llm)
    written = {r["id"]: r for r in map(json.loads, open(tmp_path / "llama.jsonl"))}
    assert all(r["backend"]["name"] == "llama.cpp" for r in written.values())
    assert [len(written[k]["assistant_token_ids"]) for k in "ab"] == [1, 2]  # one answer per user turn
    for record in written.values():
        history = [m for m in record["messages"] if m["role"] != "assistant"][:1]
        prompt = real_target.encode_chat(history)
        answer = record["assistant_token_ids"][0]
        logits = real_target.forward_sequences(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        ranks = (logits > logits.gather(1, torch.tensor(answer)[:, None])).sum(1)
        assert ranks.max() < 5, ranks.tolist()


# ---- the command line ---------------------------------------------------------------------------------------------


def test_export_and_import_through_the_command_line(saved_drafter, tmp_path, capsys):
    """`dspark export --format speculators` then `dspark import` gives back a dspark checkpoint that every command
    loads, with the same weights; a folder of no known format and an existing output are refused by name."""
    from dspark.drafter import load_drafter

    folder, ckpt, target = saved_drafter
    code, err = run_cli(capsys, "export", ckpt, tmp_path / "spec", "--model", folder, "--format", "speculators")
    assert code == 0, err
    assert (tmp_path / "spec" / "MODEL_CARD.md").is_file() and not (tmp_path / "spec" / "calibration.json").exists()
    code, err = run_cli(capsys, "import", tmp_path / "spec", tmp_path / "back", "--model", folder)
    assert code == 0 and "run `dspark calibrate`" in err, err
    original, back = load_drafter(ckpt, target), load_drafter(tmp_path / "back", target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in original.state_dict().items())
    refused(capsys, "neither a speculators DSpark folder", "import", ckpt, tmp_path / "other", "--model", folder)
    refused(capsys, "--overwrite", "import", tmp_path / "spec", tmp_path / "back", "--model", folder)
    refused(
        capsys,
        "does not exist",
        "export",
        ckpt,
        tmp_path / "g",
        "--model",
        folder,
        "--format",
        "gguf",
        "--target-gguf",
        tmp_path / "missing.gguf",
    )
