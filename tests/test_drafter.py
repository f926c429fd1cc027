"""The drafter: config validation, block visibility, head formulas, train/inference agreement, checkpoints."""

import json

import pytest
import torch

from conftest import needs_fbgemm, tiny_drafter, tiny_target
from dspark.drafter import DSparkConfig, load_drafter, new_drafter
from dspark.drafter.heads import ConfidenceHead, GatedMarkovHead, RNNHead, VanillaMarkovHead
from dspark.errors import DSparkError
from dspark.sampling import SamplingParams

HEADS = ["vanilla", "gated", "rnn"]


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(markov_rank=-1), "markov_rank"),
        (dict(markov_head_type="lstm"), "markov_head_type"),
        (dict(markov_rank=0, confidence_head_with_markov=True), "confidence_head_with_markov"),
        (dict(target_layer_ids=[0, 3]), "target_layer_ids"),  # 3 is the last of 4 layers
        (dict(target_layer_ids=[7]), "target_layer_ids"),
        (dict(mask_token_id=97), "mask_token_id"),
        (dict(block_size=0), "block_size"),
        (dict(draft_vocab_size=1000), "draft_vocab_size"),
    ],
)
def test_invalid_config_names_the_field(fields, field):
    base = dict(target_layer_ids=[0, 2], mask_token_id=96)
    base.update(fields)
    with pytest.raises(DSparkError, match=f"DSparkConfig.{field}"):
        DSparkConfig(**base).validate(num_target_layers=4, vocab_size=97)


def _teacher_forced(drafter, features, ids, anchor):
    return drafter(features, ids, torch.tensor([[anchor]]))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_train_forward_equals_propose(target, head, draft_vocab):
    drafter = tiny_drafter(target, markov_head_type=head, draft_vocab_size=draft_vocab)
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(97)[:draft_vocab].sort().values)
    ids = torch.randint(0, 90, (1, 24))
    features = torch.randn(1, 24, 64)
    anchor = 11
    cache = drafter.new_cache(1)
    drafter.extend_context(cache, features[:, :anchor], torch.tensor([anchor]))
    params = SamplingParams(temperature=1.0, seed=0)
    proposal = drafter.propose(cache, ids[:, anchor], params, params.generators(1))
    # Teacher-force the sampled tokens: the training forward must then give the very distributions sampled from.
    forced = ids.clone()
    forced[0, anchor + 1 : anchor + 1 + drafter.block_size] = proposal.tokens[0]
    out = _teacher_forced(drafter, features, forced, anchor)
    probs = torch.softmax(out.logits[0, 0], dim=-1)
    if draft_vocab:
        probs = torch.zeros(drafter.block_size, 97).index_copy(1, drafter.d2t, probs)
    torch.testing.assert_close(probs, proposal.probs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.confidence_logits[0, 0], proposal.confidence_logits[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.labels[0, 0], proposal.tokens[0])


def test_block_never_sees_context_at_or_after_its_anchor(target):
    drafter = tiny_drafter(target, markov_head_type="rnn")
    ids = torch.randint(0, 90, (1, 30))
    features = torch.randn(1, 30, 64)
    anchors = torch.tensor([[4, 12, 20]])
    base = drafter(features, ids, anchors).logits
    for cut in (12, 13, 25):
        perturbed = features.clone()
        perturbed[:, cut:] += 5 * torch.randn_like(perturbed[:, cut:])
        out = drafter(perturbed, ids, anchors).logits
        for a, anchor in enumerate(anchors[0].tolist()):
            changed = not torch.allclose(out[0, a], base[0, a])
            assert changed == (anchor > cut), (cut, anchor)


def test_blocks_do_not_see_each_other(target):
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 90, (1, 30))
    features = torch.randn(1, 30, 64)
    together = drafter(features, ids, torch.tensor([[5, 15]])).logits
    alone = drafter(features, ids, torch.tensor([[15]])).logits
    torch.testing.assert_close(together[:, 1], alone[:, 0], rtol=1e-5, atol=1e-5)


def test_rank_zero_is_pure_parallel(target):
    drafter = tiny_drafter(target, markov_rank=0, confidence_head_with_markov=False)
    assert drafter.markov_head is None
    ids = torch.randint(0, 90, (1, 20))
    features = torch.randn(1, 20, 64)
    out = drafter(features, ids, torch.tensor([[8]]))
    ids2 = ids.clone()
    ids2[0, 9:14] = torch.randint(0, 90, (5,))  # other earlier-position tokens: logits must not move
    out2 = drafter(features, ids2, torch.tensor([[8]]))
    torch.testing.assert_close(out.logits, out2.logits)


def test_vanilla_head_formula():
    head = VanillaMarkovHead(vocab_size=5, rank=2, hidden_size=3, draft_vocab_size=4)
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.arange(10.0).view(5, 2))
        head.markov_w2.weight.copy_(torch.tensor([[1.0, 0], [0, 1], [1, 1], [1, -1]]))
    bias = head.block(torch.tensor([[3]]), torch.zeros(1, 1, 3))
    # W1[3] = (6, 7); W2 @ (6, 7) = (6, 7, 13, -1)
    assert torch.equal(bias[0, 0], torch.tensor([6.0, 7.0, 13.0, -1.0]))


def test_gated_head_formula():
    torch.manual_seed(0)
    head = GatedMarkovHead(vocab_size=5, rank=2, hidden_size=3, draft_vocab_size=4)
    h = torch.randn(3)
    e = head.markov_w1.weight[2]
    gate = torch.sigmoid(head.gate_proj.weight @ torch.cat([h, e]) + head.gate_proj.bias)
    expected = head.markov_w2.weight @ (gate * e)
    torch.testing.assert_close(head.block(torch.tensor([[2]]), h.view(1, 1, 3))[0, 0], expected)


def test_rnn_head_formula_two_steps():
    torch.manual_seed(0)
    head = RNNHead(vocab_size=5, rank=2, hidden_size=3, draft_vocab_size=4)
    prev = torch.tensor([[1, 4]])
    h = torch.randn(1, 2, 3)
    W, b, W2 = head.joint_proj.weight, head.joint_proj.bias, head.markov_w2.weight
    s = torch.zeros(2)
    expected = []
    for k in range(2):
        z = torch.cat([s, head.markov_w1.weight[prev[0, k]], h[0, k]])
        g, c, o = (W @ z + b).chunk(3)
        s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
        expected.append(W2 @ torch.tanh(o))
    torch.testing.assert_close(head.block(prev, h)[0], torch.stack(expected))


def test_confidence_head_formula():
    torch.manual_seed(0)
    head = ConfidenceHead(5)
    h, e = torch.randn(3), torch.randn(2)
    expected = head.proj.weight[0] @ torch.cat([h, e]) + head.proj.bias[0]
    torch.testing.assert_close(head(h[None], e[None])[0], expected)


def test_checkpoint_round_trip_is_bit_exact(target, tmp_path):
    drafter = tiny_drafter(target, markov_head_type="gated", draft_vocab_size=30)
    drafter.set_draft_vocab(torch.arange(60, 90))
    drafter.save(tmp_path / "d", target.identity())
    loaded = load_drafter(tmp_path / "d", target)
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("embed" in k or "lm_head" in k for k in a)  # the target's shared weights are not stored
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    assert meta["target"]["fingerprint"] == target.fingerprint
    assert not list(tmp_path.glob("*.pt")) and not list((tmp_path / "d").glob("*.bin"))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
def test_a_drafter_loaded_for_a_packed_target_proposes_through_packed_matrices(tmp_path):
    """load_drafter gives the drafter the target's product form: with packed bfloat16 weights its proposals keep to
    the unpacked drafter's (the same distributions up to bfloat16 rounding), its checkpoint is unchanged, and
    unpacking restores the very same products."""
    from dspark.products import PackedLinear, packing_available

    target = tiny_target(hidden=64, dtype=torch.bfloat16)
    if not packing_available(target.lm_head.weight):
        pytest.skip("oneDNN's bfloat16 kernels do not run on this CPU")
    tiny_drafter(target, draft_vocab_size=40).save(tmp_path / "d", target.identity())
    drafter = load_drafter(tmp_path / "d", target.use_packed_weights(True))
    assert sum(isinstance(m, PackedLinear) for m in drafter.modules()) == 3  # fc, Markov head, confidence head
    assert all(products is not None for _, products in drafter.layers_for_inference())  # the layers' own form
    for_int8 = load_drafter(tmp_path / "d", tiny_target(hidden=64, dtype=torch.bfloat16).quantize("int8"))
    assert sum(isinstance(m, PackedLinear) for m in for_int8.modules()) == 3  # an int8 target's drafter is bfloat16
    saved = load_drafter(tmp_path / "d", target.use_packed_weights(False))
    assert drafter.state_dict().keys() == saved.state_dict().keys()
    features = torch.randn(1, 12, drafter.fc.in_features, dtype=torch.bfloat16)
    anchor = torch.tensor([5])
    proposals = []
    for packed in (True, False):
        drafter.use_product_form("packed" if packed else "plain")
        cache = drafter.new_cache(1)
        drafter.extend_context(cache, features, torch.tensor([12]))
        params = SamplingParams(temperature=1.0, seed=0)
        proposals.append(drafter.propose(cache, anchor, params, params.generators(1)))
    torch.testing.assert_close(proposals[0].probs, proposals[1].probs, rtol=0.05, atol=0.02)
    assert not any(isinstance(m, PackedLinear) for m in drafter.modules())
    assert all(products is None for _, products in drafter.layers_for_inference())
    cache = saved.new_cache(1)
    saved.extend_context(cache, features, torch.tensor([12]))
    params = SamplingParams(temperature=1.0, seed=0)
    assert torch.equal(saved.propose(cache, anchor, params, params.generators(1)).probs, proposals[1].probs)


@needs_fbgemm
def test_a_drafter_proposes_through_float16_products_near_its_own_and_back(monkeypatch):
    """The float16 form (FBGEMM's weights, chosen where the target's LM head found them faster): every product a
    proposal makes goes through it, the proposals stay near the plain drafter's, and "plain" restores its exact
    products; an unknown form is refused."""
    from dspark.products import Float16Weight, PackedLinear

    target = tiny_target(hidden=64, dtype=torch.bfloat16)
    drafter = tiny_drafter(target, draft_vocab_size=40).to(torch.bfloat16).eval()
    features = torch.randn(1, 12, drafter.fc.in_features, dtype=torch.bfloat16)

    def propose():
        cache = drafter.new_cache(1)
        drafter.extend_context(cache, features, torch.tensor([12]))
        params = SamplingParams(temperature=1.0, seed=0)
        return drafter.propose(cache, torch.tensor([5]), params, params.generators(1)).probs

    plain = propose()
    drafter.use_product_form("float16")
    assert {type(m.form) for m in drafter.modules() if isinstance(m, PackedLinear)} == {Float16Weight}
    assert all(isinstance(p.gate_up.weight, Float16Weight) for _, p in drafter.layers_for_inference())
    shapes = []
    product = Float16Weight.__call__
    monkeypatch.setattr(
        Float16Weight, "__call__", lambda self, rows: shapes.append(self.dense.shape) or product(self, rows)
    )
    in_float16 = propose()
    # every product: the context's k/v, the block's q/k/v, o, gate/up and down per layer, fc, the draft LM head, ...
    assert (40, 64) in shapes and len(shapes) >= 6 * len(drafter.layers) + 2
    torch.testing.assert_close(in_float16, plain, rtol=0.05, atol=0.02)
    drafter.use_product_form("plain")
    assert torch.equal(propose(), plain)
    with pytest.raises(DSparkError, match="unknown product form"):
        drafter.use_product_form("float8")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")
def test_a_draft_layers_stacked_products_compute_what_its_modules_do_until_a_weight_changes():
    """LayerProducts multiply q/k/v, k/v and gate/up as one packed product each: the layer's output is that of its
    own modules up to bfloat16 rounding; once a weight changes (training after packing) the modules run again."""
    from dspark.drafter.backbone import LayerProducts, context_kv, layer_forward
    from dspark.products import packing_available

    target = tiny_target(hidden=64, dtype=torch.bfloat16)
    if not packing_available(target.lm_head.weight):
        pytest.skip("oneDNN's bfloat16 kernels do not run on this CPU")
    drafter = tiny_drafter(target).to(torch.bfloat16)
    layer = drafter.layers[0]
    products = LayerProducts(layer)
    x, ctx = torch.randn(2, 4, 64, dtype=torch.bfloat16), torch.randn(2, 6, 64, dtype=torch.bfloat16)
    positions = torch.arange(6).expand(2, 6)
    cos, sin = drafter.rotary_emb(x, positions)
    with torch.no_grad():
        kv = [context_kv(layer, ctx, cos, sin, p) for p in (products, None)]
        for a, b in zip(*kv):
            torch.testing.assert_close(a, b, rtol=0.02, atol=0.02)
        k, v = kv[1]
        fused, plain = (layer_forward(layer, x, cos[:, :4], sin[:, :4], k, v, None, p) for p in (products, None))
        for a, b in zip(fused, plain):
            torch.testing.assert_close(a, b, rtol=0.02, atol=0.05)
        assert products.usable()
        layer.mlp.down_proj.weight.add_(1.0)
        assert not products.usable()
        after = layer_forward(layer, x, cos[:, :4], sin[:, :4], k, v, None, products)
        assert torch.equal(after[0], layer_forward(layer, x, cos[:, :4], sin[:, :4], k, v, None, None)[0])
        assert not torch.equal(after[0], fused[0])
    assert not LayerProducts(layer).usable()  # gradients wanted: the modules run


def test_checkpoint_for_another_target_is_refused(target, tmp_path):
    tiny_drafter(target).save(tmp_path / "d", target.identity())
    other = tiny_target(vocab_size=101)
    with pytest.raises(DSparkError, match="trained for target"):
        load_drafter(tmp_path / "d", other)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(DSparkError, match="not a drafter checkpoint"):
        load_drafter(tmp_path, tiny_target())


@pytest.mark.real
def test_drafter_on_real_target_config(real_target):
    drafter = new_drafter(real_target, DSparkConfig(num_draft_layers=1, markov_rank=16))
    assert drafter.config.target_layer_ids == [1, 8, 14, 21, 28]
    token = drafter.config.mask_token_id
    assert real_target.tokenizer.convert_ids_to_tokens(token) == "<empty_output>"
    assert drafter.init_from_target_layers(real_target.model) == [29]
    cache = drafter.new_cache(1)
    ids = torch.tensor([real_target.encode_chat("Hello there")])
    feats = real_target.forward_sequences(ids, features=True).features
    drafter.extend_context(cache, feats, torch.tensor([ids.shape[1]]))
    proposal = drafter.propose(cache, torch.tensor([42]), SamplingParams())
    confidence = torch.sigmoid(proposal.confidence_logits)
    assert proposal.tokens.shape == (1, 7) and confidence.shape == (1, 7)
    assert ((confidence > 0) & (confidence < 1)).all()
    # train forward == propose on the real dimensions (d=576, 5 fused layers, V=49152), teacher-forced
    with torch.no_grad():
        for p in drafter.markov_head.parameters():
            p.normal_(0, 0.05)
    params = SamplingParams(temperature=1.0, seed=1)
    sampled = drafter.propose(cache, torch.tensor([42]), params, params.generators(1))
    n = ids.shape[1]
    seq = torch.cat([ids[0], torch.tensor([42]), sampled.tokens[0]])[None]
    full_features = torch.cat([feats, torch.zeros(1, 8, feats.shape[-1])], dim=1)  # after the anchor: never seen
    out = drafter(full_features, seq, torch.tensor([[n]]))
    torch.testing.assert_close(torch.softmax(out.logits[0, 0], -1), sampled.probs[0], rtol=1e-3, atol=1e-5)


def test_eagle_training_chain_equals_its_inference_chain(target, tmp_path):
    """Training-time test must compute what autoregressive drafting computes, step for step (teacher forced)."""
    drafter = tiny_drafter(
        target,
        architecture="eagle3",
        block_size=4,
        num_draft_layers=1,
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )
    ids = torch.randint(0, 90, (1, 20))
    features = torch.randn(1, 20, 64)
    anchor = 9
    cache = drafter.new_cache(1)
    following = torch.cat([ids[:, 1 : anchor + 1]], dim=1)
    drafter.extend_context(cache, features[:, :anchor], torch.tensor([anchor]), following)
    params = SamplingParams(temperature=1.0, seed=0)
    proposal = drafter.propose(cache, ids[:, anchor], params, params.generators(1))
    forced = ids.clone()
    forced[0, anchor + 1 : anchor + 5] = proposal.tokens[0]
    out = drafter(features, forced, torch.tensor([[anchor]]))
    torch.testing.assert_close(torch.softmax(out.logits[0, 0], -1), proposal.probs[0], rtol=1e-4, atol=1e-5)
    drafter.save(tmp_path / "e", target.identity())
    assert type(load_drafter(tmp_path / "e", target)).__name__ == "EagleDrafter"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gemma3_text"])
def test_a_qwen3_style_backbone_drafts_for_any_family(family, tmp_path):
    """backbone=qwen3: Qwen3 layers (q/k norms) sized from the target, initialised from its layers, saved and
    reloaded, decoding losslessly."""
    from conftest import tiny_family_target
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain

    sliding = dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2)
    target = tiny_family_target(family, **(sliding if family.startswith("gemma") else {}))
    drafter = new_drafter(
        target, DSparkConfig(num_draft_layers=1, markov_rank=8, block_size=4, backbone="qwen3", mask_token_id=96)
    )
    assert type(drafter.layers[0]).__name__ == "Qwen3DecoderLayer" and hasattr(drafter.layers[0].self_attn, "q_norm")
    assert drafter.init_from_target_layers(target.model) == [3]
    source = target.model.model.layers[3]
    torch.testing.assert_close(drafter.layers[0].mlp.down_proj.weight, source.mlp.down_proj.weight)
    if family.startswith("gemma"):  # Gemma norms scale by 1 + w, Qwen3's by w; the drafter embeds as Gemma does
        torch.testing.assert_close(drafter.layers[0].input_layernorm.weight, source.input_layernorm.weight + 1)
        assert drafter.embed_scale == 32**0.5
    drafter.save(tmp_path / "d", target.identity())
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.config.backbone == "qwen3"
    prompts = [[3, 9, 14], [5, 6]]
    expected = [r.token_ids for r in generate_plain(target, prompts, 16)]
    assert [r.token_ids for r in SpeculativeEngine(target, loaded).generate(prompts, 16)] == expected
