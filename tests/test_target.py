"""Target adapter: captured features, cache rollback and ragged batches, plain decoding as the reference."""

import pytest
import torch

from conftest import decode_plain_and_speculative, needs_fbgemm, tiny_drafter, tiny_target
from dspark.autotune import invariance_failures
from dspark.compiled import compile_target
from dspark.decoder import PRODUCTS
from dspark.decoding.plain import generate_plain
from dspark.errors import DSparkError
from dspark.products import MIN_ROWS_FLOAT32
from dspark.sampling import SamplingParams
from dspark.target import default_layer_ids


def test_default_layer_ids_spread_and_skip_last():
    assert default_layer_ids(30) == [1, 8, 14, 21, 28]
    assert default_layer_ids(4) == [1, 2]
    assert all(i < 29 for i in default_layer_ids(30))


def test_features_equal_hf_hidden_states(target):
    """The captured layers are HF's hidden states of those layers (to float32 rounding: our attention reads keys in
    the batch-invariant plan, HF's in one causal call)."""
    ids = torch.randint(0, 90, (2, 13))
    out = target.forward_sequences(ids, features=True, last_hidden=True)
    hs = target.model(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i + 1] for i in target.layer_ids], dim=-1)
    torch.testing.assert_close(out.features, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.last_hidden, hs[-1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out.features[..., : hs[0].shape[-1]], expected[..., hs[0].shape[-1] :])  # other layers


# Gemma 2/3: a window shorter than the sequence, so the sliding layers really forget; Gemma 2 soft-caps attention
# and final logits (eager attention on the HF side: its SDPA path cannot soft-cap).
SLIDING = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="eager")
FAMILY_EXTRAS = {
    "llama": dict(attention_bias=True),
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gemma2": dict(SLIDING, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": SLIDING,
}


@pytest.mark.parametrize("family", list(FAMILY_EXTRAS))
def test_our_forward_equals_hf_for_every_supported_family(family):
    """Logits and captured features of our decoder equal the Hugging Face model's, in float32, for a whole sequence
    and for the same sequence fed in pieces through the cache."""
    from conftest import tiny_family_target

    target = tiny_family_target(family, **FAMILY_EXTRAS[family])
    model = target.model
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases everywhere (in place: the fused views follow)
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 97, (2, 11))
    hf = model(ids, output_hidden_states=True)
    ours = target.forward_sequences(ids, features=True)
    torch.testing.assert_close(ours.logits, hf.logits.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        ours.features, torch.cat([hf.hidden_states[1], hf.hidden_states[3]], -1), rtol=1e-5, atol=1e-5
    )
    cache = target.new_cache(2)
    pieces = [target.forward(cache, ids[:, a:b]).logits for a, b in ((0, 4), (4, 5), (5, 11))]
    torch.testing.assert_close(torch.cat(pieces, 1), hf.logits.float(), rtol=1e-5, atol=1e-5)


def test_rollback_then_extend_equals_one_forward(target):
    ids = torch.randint(0, 90, (1, 20))
    full = target.forward_sequences(ids).logits
    cache = target.new_cache(1)
    target.forward(cache, ids[:, :12])
    target.forward(cache, torch.randint(0, 90, (1, 5)))  # a rejected draft ...
    cache.rollback(torch.tensor([12]))  # ... rolled back: only the length moves
    assert cache.lengths.tolist() == [12]
    tail = target.forward(cache, ids[:, 12:]).logits
    torch.testing.assert_close(tail, full[:, 12:], rtol=1e-5, atol=1e-5)


def test_ragged_batch_matches_each_row_alone(target):
    prompts = [torch.randint(0, 90, (n,)) for n in (4, 9, 6)]
    cache = target.new_cache(3)
    ids = torch.zeros(3, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    target.forward(cache, ids, torch.tensor([4, 9, 6]))
    # Each row verifies a different number of junk tokens and keeps a different number of them.
    junk = torch.randint(0, 90, (3, 4))
    target.forward(cache, junk, torch.tensor([4, 2, 3]))
    cache.rollback(cache.lengths - torch.tensor([4, 2, 3]) + torch.tensor([1, 0, 2]))
    assert cache.lengths.tolist() == [5, 9, 8]  # accepted tokens only: nothing dead below a row's length
    nxt = torch.randint(0, 90, (3, 3))
    got = target.forward(cache, nxt).logits
    for i, p in enumerate(prompts):
        kept = {0: junk[0, :1], 1: junk[1, :0], 2: junk[2, :2]}[i]
        seq = torch.cat([p, kept, nxt[i]])[None]
        alone = target.forward_sequences(seq).logits[0, -3:]
        torch.testing.assert_close(got[i], alone, rtol=1e-5, atol=1e-5)


def test_a_ragged_forward_multiplies_only_its_real_tokens(target, monkeypatch):
    """Rows of 3, 1 and 2 real tokens in a forward 3 wide: every matrix product sees the 6 real tokens, not 9
    (a scheduled verify costs what it verifies), and the real positions are what an unpacked forward gives."""
    import dspark.decoder as decoder

    cache = target.new_cache(3)
    target.forward(cache, torch.randint(0, 90, (3, 5)))
    ids, num_new = torch.randint(0, 90, (3, 3)), torch.tensor([3, 1, 2])
    seen, linear = [], decoder.linear
    monkeypatch.setattr(
        decoder, "linear", lambda x, *a, **k: seen.append(x.numel() // x.shape[-1]) or linear(x, *a, **k)
    )
    packed = target.forward(cache, ids, num_new, features=True)
    assert seen and set(seen) == {6}
    cache.rollback(cache.lengths - num_new)
    monkeypatch.setattr(decoder, "linear", linear)
    full = target.forward(cache, ids, torch.tensor([3, 3, 3]), features=True)
    for row, n in enumerate(num_new.tolist()):
        torch.testing.assert_close(packed.logits[row, :n], full.logits[row, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.features[row, :n], full.features[row, :n], rtol=1e-5, atol=1e-5)


def test_cache_grows_selects_and_merges(target):
    """Rows leave (select) and join (merge) between steps, across a growth of the buffer, without changing results."""
    seqs = [torch.randint(0, 90, (n,)) for n in (70, 5, 30)]
    a = target.new_cache(2)
    target.forward(a, torch.stack([seqs[0][:40], torch.cat([seqs[1], seqs[1].new_zeros(35)])]), torch.tensor([40, 5]))
    b = target.new_cache(1)
    target.forward(b, seqs[2][None])
    a.merge(b)
    a.select(torch.tensor([0, 2]))  # the short row leaves; the merged one stays
    got = target.forward(a, torch.stack([seqs[0][40:70], torch.randint(0, 90, (30,))]), torch.tensor([30, 1])).logits
    assert a.capacity >= 70
    torch.testing.assert_close(got[0], target.forward_sequences(seqs[0][None]).logits[0, 40:], rtol=1e-5, atol=1e-5)


def test_plain_batch_equals_single_requests():
    target = tiny_target(eos=7)
    prompts = [torch.randint(8, 90, (n,)).tolist() for n in (3, 8, 5, 1)]
    batch = generate_plain(target, prompts, 25)
    for p, r in zip(prompts, batch):
        assert r.token_ids == generate_plain(target, [p], 25)[0].token_ids
    assert all(len(r.token_ids) == 25 or r.token_ids[-1] == 7 for r in batch)


def test_plain_sampling_is_reproducible_with_seed(target):
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3)
    a = generate_plain(target, [[3, 4, 5]], 20, params)[0].token_ids
    b = generate_plain(target, [[3, 4, 5]], 20, params)[0].token_ids
    assert a == b


def test_bad_requests_are_refused(target):
    with pytest.raises(DSparkError, match="empty"):
        generate_plain(target, [[]], 5)
    with pytest.raises(DSparkError, match="max_new_tokens"):
        generate_plain(target, [[1, 2]], 0)
    with pytest.raises(DSparkError, match="target_layer_ids"):
        target.validate_layer_ids([3])  # the last of 4 layers


@pytest.mark.slow
@pytest.mark.real
def test_plain_greedy_equals_hf_generate_on_real_target(real_target):
    prompt = real_target.encode_chat("Write a haiku about the sea")
    ours = generate_plain(real_target, [prompt], 40)[0].token_ids
    hf = real_target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    assert ours == hf[0, len(prompt) :].tolist()[: len(ours)]
    assert len(ours) == 40 or ours[-1] in real_target.stop_token_ids


@pytest.mark.real
def test_real_target_features_equal_hf(real_target):
    ids = torch.tensor([real_target.encode_chat("What is the capital of France?")])
    out = real_target.forward_sequences(ids, features=True)
    hf = real_target.model(ids, output_hidden_states=True)
    assert real_target.layer_ids == [1, 8, 14, 21, 28]
    torch.testing.assert_close(
        out.features, torch.cat([hf.hidden_states[i + 1] for i in real_target.layer_ids], -1), rtol=1e-5, atol=1e-4
    )
    torch.testing.assert_close(out.logits, hf.logits.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_compute_the_same_products_and_are_chosen_by_measurement(tmp_path, monkeypatch, dtype):
    """decoder.PackedWeight: one reorder into oneDNN's layout, then every product (1 row, a verify, a batch) as
    F.linear gives it; the target switches all its matrices at once and back, and a machine's recorded choice is
    applied at load."""
    import json

    from dspark.autotune import choose_product_forms
    from dspark.products import PackedWeight, linear, packing_available

    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    if not packing_available(w):
        pytest.skip(f"oneDNN's {dtype} products do not run on this CPU (or torch has no oneDNN)")
    for rows in (1, 8, 64):
        x = torch.randn(rows, 1, 64, dtype=dtype)
        torch.testing.assert_close(
            linear(x, PackedWeight(w), b), torch.nn.functional.linear(x, w, b), rtol=1e-2, atol=1e-2
        )

    target = tiny_target(eos=7, dtype=dtype)
    ids = torch.randint(0, 90, (1, 16))
    logits = []
    for packed in (False, True, False):
        target.use_packed_weights(packed)
        matrices = [getattr(layer, name) for layer in target.decoder.layers for name in PRODUCTS]
        assert all(isinstance(m, PackedWeight) == packed for m in matrices + [target.head.form])
        cache = target.new_cache(1)
        target.forward(cache, ids[:, :12])
        logits.append(target.forward(cache, ids[:, 12:]).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=2e-2, atol=2e-2)
    assert torch.equal(logits[0], logits[2])  # unpacking restores the very same matrices
    from dspark.bench.engine import streamed_bytes

    assert streamed_bytes(target.use_packed_weights(True)) == streamed_bytes(target.use_packed_weights(False))

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    choose_product_forms(target, repeats=1)  # measured once (a quiet machine finds a tiny model not worth packing)
    [saved] = (tmp_path / "kernels").glob(f"tiny-97-0-{str(dtype).removeprefix('torch.')}-*.json")
    assert isinstance(json.loads(saved.read_text())["packed"], bool)
    saved.write_text(json.dumps({"packed": False}))
    assert not isinstance(choose_product_forms(target).head.form, PackedWeight)
    saved.write_text(json.dumps({"packed": True}))  # as on the AMX Xeon
    assert isinstance(choose_product_forms(target).head.form, PackedWeight)
    saved.write_text("{torn")
    choose_product_forms(target, repeats=1)  # a damaged record is measured again
    assert "verify_4_and_8_ms" in json.loads(saved.read_text())


@pytest.mark.parametrize("packed", [False, True])
def test_a_column_split_product_is_the_sum_of_its_blocks_whatever_rows_share_it(packed):
    """decoder.KSplitWeight: one product of the stacked blocks gives, for every row, the float32 sum of its
    block-by-block products rounded once, and a row's result does not depend on the rows beside it."""
    from dspark.products import MAX_INVARIANT_K, KSplitWeight, linear, packing_available

    torch.manual_seed(0)
    w = (0.05 * torch.randn(96, 2 * MAX_INVARIANT_K)).bfloat16()
    if packed and not packing_available(w):
        pytest.skip("oneDNN's bfloat16 products do not run on this CPU (or torch has no oneDNN)")
    split = KSplitWeight(w, packed)
    assert split.splits == 2
    x = torch.randn(16, 2 * MAX_INVARIANT_K).bfloat16()
    blocks = [linear(x[:, i : i + MAX_INVARIANT_K], w[:, i : i + MAX_INVARIANT_K]) for i in (0, MAX_INVARIANT_K)]
    every = linear(x, split)
    assert torch.equal(every, (blocks[0].float() + blocks[1].float()).bfloat16())
    for rows in (1, 2, 3, 8):
        assert torch.equal(linear(x[:rows], split), every[:rows])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
def test_a_packed_linear_keeps_the_layer_and_multiplies_what_the_weight_holds_now():
    """decoder.PackedLinear: the same parameters (state dict unchanged), a product close to F.linear's, F.linear
    itself once the weight changed after packing or where a gradient is wanted, and the nn.Linear back."""
    from dspark.products import PackedLinear, PackedWeight, packing_available

    layer = torch.nn.Linear(64, 96).bfloat16()
    if not packing_available(layer.weight):
        pytest.skip("oneDNN's bfloat16 kernels do not run on this CPU")
    packed = PackedLinear(layer)
    assert packed.state_dict().keys() == layer.state_dict().keys() and packed.weight is layer.weight
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(packed(x), layer(x), rtol=1e-2, atol=1e-2)
        packed.form = PackedWeight(torch.zeros_like(layer.weight))  # what the packed form is used for is visible
        assert not packed(x).equal(layer(x))
        layer.weight.add_(1.0)  # changed in place (an optimizer step): the packed copy is stale
        assert torch.equal(packed(x), layer(x))
    packed.packed_from = (layer.weight.data_ptr(), layer.weight._version)
    assert torch.equal(packed(x), layer(x))  # gradients wanted: the plain product
    plain = packed.plain()
    assert type(plain) is torch.nn.Linear and plain.weight is layer.weight and plain.bias is layer.bias


def test_folded_and_causal_attention_equal_grouped_attention_under_the_mask():
    """The CUDA forms (query heads folded into the query length; causal with no mask) compute what enable_gqa with
    the explicit mask computes; here on the CPU, forced."""
    from dspark.attention import attention
    from dspark.kvcache import causal_visibility

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 5, 8), torch.randn(3, 2, 11, 8), torch.randn(3, 2, 11, 8)
    mask = torch.rand(3, 1, 5, 11) > 0.3
    mask[..., 0] = True  # every query sees something
    reference = attention(q, k, v, mask, 0.3, fold=False)
    assert torch.allclose(attention(q, k, v, mask, 0.3, fold=True), reference, atol=1e-6)
    grouped = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=0.3
    )
    assert torch.allclose(reference, grouped, atol=1e-6)  # query head h reads key head h // 3
    square = torch.randn(3, 2, 5, 8)
    causal = causal_visibility(torch.arange(5).expand(3, 5), 5)
    assert torch.allclose(
        attention(q, square, square, None, 0.3, causal=True),
        attention(q, square, square, causal, 0.3, fold=True),
        atol=1e-6,
    )


# ---- batch invariance: a row's logits do not depend on how many rows or tokens share the forward --------------------
def test_a_bfloat16_row_is_the_same_alone_in_a_block_and_in_a_ragged_batch():
    target = tiny_target(hidden=64, dtype=torch.bfloat16)
    assert target.decoder.batch_invariant
    assert invariance_failures(target, prompt_len=70) == []


@pytest.mark.parametrize("packed", [False, True])
def test_a_float32_row_is_the_same_alone_in_a_block_and_in_a_ragged_batch_through_padded_products(packed):
    """float32 products of 1-3 rows round unlike those of 4 or more (MKL picks other kernels; oneDNN's packed
    product another for 1 row): padded to MIN_ROWS_FLOAT32 rows, a step equals the same row in any block; unpadded,
    it does not."""
    target = tiny_target(hidden=64, dtype=torch.float32).use_packed_weights(packed)
    assert target.decoder.batch_invariant and target.decoder.min_rows == MIN_ROWS_FLOAT32
    assert invariance_failures(target, prompt_len=70) == []
    target.decoder.min_rows = 1
    assert invariance_failures(target, prompt_len=70, ragged=False) != []  # the padding is what makes it hold


@needs_fbgemm
def test_float16_products_of_a_row_are_the_same_whatever_rows_share_them():
    """FBGEMM's kernels of 1-2 rows round unlike those of 3-6 on some CPUs: every count of rows is padded to one its
    kernels agree on, so each row of a product of 1..300 rows (several calls beyond FLOAT16_ROWS) is its product
    alone; the sums are float32 sums of float16 weights. Without the padding the rows differ."""
    from dspark.products import FLOAT16_ROWS, Float16Weight, float16_row_counts, linear

    g = torch.Generator().manual_seed(0)
    weight, rows = torch.randn(200, 576, generator=g).bfloat16(), torch.randn(300, 576, generator=g).bfloat16().float()
    form = Float16Weight(weight)
    together = form(rows)
    assert together.dtype == torch.float32 and len(float16_row_counts()) == FLOAT16_ROWS + 1
    assert all(torch.equal(form(rows[:n]), together[:n]) for n in range(1, 300))
    assert all(torch.equal(form(rows[i : i + 1]), together[i : i + 1]) for i in range(0, 300, 7))
    torch.testing.assert_close(together, rows @ weight.float().T, rtol=0, atol=2e-3)
    assert torch.equal(linear(rows[:5].bfloat16(), form), together[:5].bfloat16())  # rounded to the rows' precision
    unpadded = torch.ops.quantized.linear_dynamic_fp16(rows[:8].float(), form.packed)
    differ = [
        n
        for n in range(1, 9)
        if not torch.equal(torch.ops.quantized.linear_dynamic_fp16(rows[:n].float(), form.packed), unpadded[:n])
    ]
    assert bool(differ) == any(float16_row_counts()[n] != n for n in range(1, 9))


@needs_fbgemm
@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_float16_lm_head_keeps_a_row_the_same_alone_in_a_block_and_in_a_ragged_batch(quantize):
    """A bfloat16 or int4 target whose LM head runs through FBGEMM's float16 weights: float32 logits near the
    bfloat16 head's, batch-invariant, and plain decoding equals speculative decoding; switching back restores the
    head it had."""
    from dspark.products import Float16Weight, PackedWeight, dense

    target = tiny_target(hidden=64, dtype=torch.bfloat16)
    if quantize:
        target.quantize(quantize)
    before = target.head.form
    ids = torch.randint(0, 90, (1, 30))
    model_logits = target.prefill(target.new_cache(1), ids).logits
    target.head.use_float16(True)
    assert target.head.form_name == "float16"
    logits = target.prefill(target.new_cache(1), ids).logits
    assert not torch.equal(logits, model_logits) and torch.allclose(logits, model_logits, atol=0.05)
    assert logits.dtype == torch.float32 and not torch.equal(logits, logits.bfloat16().float())
    assert invariance_failures(target, prompt_len=70) == []
    expected, results = decode_plain_and_speculative(target)
    assert [r.token_ids for r in results] == expected
    target.head.use_float16(False)
    back = target.head.form
    assert (
        isinstance(back, type(before)) and torch.equal(dense(back), dense(before)) and target.head.form_name == "model"
    )
    # Other forms keep the float16 head, and switching back gives the form chosen meanwhile (plain, not packed).
    target.head.use_float16(True)
    assert isinstance(target.use_packed_weights(False).head.form, Float16Weight)
    target.head.use_float16(False)
    assert not isinstance(target.head.form, PackedWeight)
    with pytest.raises(DSparkError, match="float16 LM head"):
        tiny_target(hidden=64, dtype=torch.float32).head.use_float16(True)


@pytest.mark.real
@pytest.mark.parametrize(
    "precision",
    [
        "float32",
        "float32-packed",
        "bfloat16",
        "bfloat16-packed",
        "bfloat16-float16-head",
        "int8",
        "int4",
        "int4-float32-prompts",
        "int4-float16-head",
    ],
)
@pytest.mark.slow
def test_the_real_target_is_batch_invariant_in_every_precision_auto_can_pick(precision, real_targets):
    from dspark.products import packing_available

    quantize = next((kind for kind in ("int8", "int4") if precision.startswith(kind)), None)
    target = real_targets(quantize or precision.split("-")[0])  # one load per precision; every form set below
    packed = precision.endswith("packed")
    if packed and not packing_available(target.lm_head.weight):
        pytest.skip(f"oneDNN's {target.dtype} kernels do not run on this CPU")
    if quantize is None:
        target.use_packed_weights(packed)
    else:
        target.decoder.use_prefill_form("float32" if precision.endswith("prompts") else "bfloat16")
    float16_head = precision.endswith("float16-head")
    if float16_head and not target.head.float16_possible():
        pytest.skip("FBGEMM's float16 products are x86-only")
    target.head.use_float16(float16_head)
    # 100 prompt tokens: the blocks after them read keys of two 64-key groups, as a longer prompt's would
    assert invariance_failures(target, prompt_len=100) == []


def test_the_rescored_head_scores_its_best_tokens_exactly_and_each_row_as_alone():
    from dspark.products import RescoredHead

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=g).bfloat16()  # a vocabulary the 4-bit kernel must pad (rows by 16)
    hidden = torch.randn(12, 64, generator=g).bfloat16()
    logits = RescoredHead(weight)(hidden)
    exact = hidden.double() @ weight.double().T
    best = exact.topk(8).indices
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(logits.gather(1, best).double(), exact.gather(1, best), rtol=0, atol=1e-4)
    assert (logits.double() - exact).abs().max() > 0.01  # the tail keeps its 4-bit scores
    head = RescoredHead(weight)
    for width in (1, 3, 4):
        for start in range(0, 12, width):
            assert torch.equal(head(hidden[start : start + width]), logits[start : start + width])


@pytest.mark.slow
@pytest.mark.real
def test_the_real_targets_rescored_head_picks_the_exact_greedy_token(real_targets):
    from dspark.assets import eval_prompts

    target = real_targets("int4")
    target.head.use_float16(False)
    target.head.use_rescored()
    prompts = [target.encode_chat(eval_prompts(name, 1)[0]) for name in ("gsm8k", "humaneval", "mt-bench")]
    for prompt, answer in zip(prompts, generate_plain(target, prompts, 48)):
        ids = torch.tensor([prompt + answer.token_ids])
        out = target.forward_sequences(ids, last_hidden=True)
        exact = out.last_hidden[0].double() @ target.lm_head.weight.double().T
        top2 = exact.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 1e-6  # an exact tie may go either way
        assert torch.equal(out.logits[0].argmax(-1)[clear], exact.argmax(-1)[clear])


# ---- the compiled decode step: one graph for every one-row forward ----------------------------------------------------
@pytest.fixture(scope="module")
def compiled_tiny():
    # Compiled (both graphs, in compile()) into the session's inductor cache (conftest), kept between runs.
    return compile_target(tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4"))


@pytest.mark.slow
def test_a_compiled_row_is_the_same_alone_and_in_every_block(compiled_tiny):
    from torch._dynamo.utils import counters

    from dspark.products import RescoredHead

    assert counters["stats"]["unique_graphs"] >= 2  # compile() built both graphs (one 64-key group, two)
    assert isinstance(compiled_tiny.head.form, RescoredHead)  # its rows' logits too, checked below
    # 58 + 12 tokens: blocks that cross from one 64-key group into the next, as decoding does
    assert invariance_failures(compiled_tiny, prompt_len=58, ragged=False) == []


@pytest.mark.slow
def test_compiled_speculative_output_is_plain_output(compiled_tiny):
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain
    from dspark.decoding.policy import FixedLength

    prompts = [[3, 14, 15, 92, 65], list(range(10, 70))]  # the second crosses into the next 64 keys while decoding
    engine = SpeculativeEngine(compiled_tiny, tiny_drafter(compiled_tiny), FixedLength())
    for prompt in prompts:
        plain = generate_plain(compiled_tiny, [prompt], 24)[0]
        spec = engine.generate([prompt], 24)[0]
        assert spec.stats.rounds < len(spec.token_ids)  # drafts were verified, several tokens a forward
        assert spec.token_ids == plain.token_ids


@needs_fbgemm
@pytest.mark.parametrize("float16_head", [False, True])
def test_compiling_keeps_a_float16_head_the_machine_chose_and_else_rescores(monkeypatch, float16_head):
    """The compiled target's LM head: the float16 one where the machine's tuning chose it (it reads the head faster
    than the rescored 4-bit one where it was chosen), else the rescored head. The graph itself is not built here."""
    from dspark.products import Float16Weight, RescoredHead

    target = tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4")
    target.head.use_float16(float16_head)
    monkeypatch.setattr(target.decoder, "compile", lambda: None)
    head = compile_target(target).head.form
    assert isinstance(head, Float16Weight if float16_head else RescoredHead)


@pytest.mark.slow
def test_a_compiled_target_stays_close_to_the_eager_one_and_refuses_batches(compiled_tiny):
    eager = tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int4")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89]])
    a, b = eager.new_cache(1), compiled_tiny.new_cache(1)
    eager.prefill(a, ids[:, :4])
    compiled_tiny.prefill(b, ids[:, :4])
    torch.testing.assert_close(
        compiled_tiny.forward(b, ids[:, 4:]).logits, eager.forward(a, ids[:, 4:]).logits, atol=0.1, rtol=0.05
    )
    two = compiled_tiny.new_cache(2)
    compiled_tiny.prefill(two, ids.expand(2, -1))
    with pytest.raises(DSparkError, match="one request at a time"):
        compiled_tiny.forward(two, ids[:, :2].expand(2, -1))


@pytest.mark.slow
def test_the_compiled_step_checks_its_inputs_and_fixes_its_weights(compiled_tiny):
    from types import SimpleNamespace

    from dspark.decoder import step_guards

    names = ["x", "keys[0]", "values[0]", "plan[1][2]", "keys[1]", "values[29]", "self.layers[0].qkv", "self.eps"]
    assert step_guards([SimpleNamespace(name=n) for n in names]) == [True] * 4 + [False] * 4
    # The graph no longer checks the decoder's matrices, so nothing may swap them.
    with pytest.raises(DSparkError, match="weights are fixed"):
        compiled_tiny.use_packed_weights(not compiled_tiny.decoder.packed)
    with pytest.raises(DSparkError, match="weights are fixed"):
        compiled_tiny.quantize("int8")


def test_compiling_needs_an_int4_target():
    for target in (tiny_target(), tiny_target(hidden=64, dtype=torch.bfloat16)):
        with pytest.raises(DSparkError, match="--compile runs int4 targets"):
            compile_target(target)
