"""The speculative engine is lossless: greedy output identical to plain decoding, sampling distribution equal to the
target's (chi-square), stop tokens and max_new_tokens honoured exactly, for single requests and ragged batches."""

import itertools
import time

import pytest
import torch
from scipy.stats import chisquare

from conftest import NoisyOracle, tiny_drafter, tiny_target
from dspark.decoding import verify
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.plain import generate_plain
from dspark.decoding.policy import ConfidenceThreshold, FixedLength
from dspark.errors import DSparkError
from dspark.sampling import SamplingParams


def prompts_for(target, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, target.vocab_size - 2, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_identical_to_plain(head, gamma):
    target = tiny_target(eos=7, seed=gamma)
    engine = SpeculativeEngine(target, tiny_drafter(target, block_size=gamma, markov_head_type=head))
    prompts = prompts_for(target, [6, 1, 13, 4], seed=gamma)
    expected = [r.token_ids for r in generate_plain(target, prompts, 30)]
    assert [r.token_ids for r in engine.generate(prompts, 30)] == expected  # a ragged batch of 4
    assert engine.generate(prompts[:1], 30)[0].token_ids == expected[0]  # batch of one


def test_greedy_identical_with_reduced_vocab_and_no_heads():
    target = tiny_target(eos=7)
    for overrides in (dict(draft_vocab_size=50), dict(markov_rank=0, confidence_head_with_markov=False)):
        engine = SpeculativeEngine(target, tiny_drafter(target, **overrides))
        prompts = prompts_for(target, [5, 9, 3])
        assert [r.token_ids for r in engine.generate(prompts, 25)] == [
            r.token_ids for r in generate_plain(target, prompts, 25)
        ]


def test_greedy_identical_under_threshold_and_short_policies():
    target = tiny_target(eos=7)
    prompts = prompts_for(target, [5, 9, 3])
    expected = [r.token_ids for r in generate_plain(target, prompts, 25)]
    for policy, most in ((ConfidenceThreshold(0.5), 6), (FixedLength(0), 0), (FixedLength(3), 3)):
        engine = SpeculativeEngine(target, tiny_drafter(target, block_size=6), policy)
        results = engine.generate(prompts, 25)
        assert [r.token_ids for r in results] == expected
        for r in results:  # never more accepted than the policy let through
            assert not any(r.stats.accepted_hist[most + 1 :]) and r.stats.verified_tokens <= most * r.stats.rounds


def oracle_policies(batch: int):
    """Each policy, the scheduler with a cost curve that makes a few drafts per request worth verifying."""
    from dspark.scheduling.planner import PrefixScheduler, ProductionScheduler
    from dspark.scheduling.profile import CostTable

    curve = CostTable([batch, 2 * batch, 4 * batch, 8 * batch], [10.0, 11.0, 13.0, 20.0])
    return {
        "fixed": FixedLength(),
        "threshold": ConfidenceThreshold(0.6),
        "scheduler": PrefixScheduler(curve),
        "production": ProductionScheduler(curve),
    }


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler", "production"])
@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_identical_with_a_noisy_oracle_in_ragged_batches(gamma, policy):
    """Most drafts are right, a random few wrong: acceptance of whole blocks, rejection at every position and the
    bonus token all occur, in rows that drift apart."""
    target = tiny_target(eos=7, seed=gamma)
    prompts = prompts_for(target, [6, 1, 13, 4, 9], seed=gamma)
    expected = [r.token_ids for r in generate_plain(target, prompts, 40)]
    engine = SpeculativeEngine(
        target,
        NoisyOracle(target, prompts, block_size=gamma, noise=0.25, seed=gamma),
        oracle_policies(len(prompts))[policy],
    )
    results = engine.generate(prompts, 40)
    assert [r.token_ids for r in results] == expected
    accepted = sum(r.stats.tokens - r.stats.rounds for r in results)
    assert accepted >= 0.3 * sum(len(r.token_ids) for r in results)  # the test exercised acceptance, not only rejection
    if gamma > 1:  # several drafts accepted in one round (whole blocks, then the bonus, under fixed γ)
        assert any(r.stats.accepted_hist[-1 if policy == "fixed" else 2] for r in results)


def test_stop_token_inside_an_accepted_block_stops_exactly_there():
    target = tiny_target(eos=7)
    prompt = prompts_for(target, [6])[0]
    free = generate_plain(target, [prompt], 40, stop_token_ids=set())[0].token_ids
    stop = free[17]  # a token the target emits mid-stream
    expected = generate_plain(target, [prompt], 40, stop_token_ids={stop})[0].token_ids
    engine = SpeculativeEngine(target, NoisyOracle(target, [prompt], block_size=7, noise=0.0))
    result = engine.generate([prompt], 40, stop_token_ids={stop})[0]
    assert result.token_ids == expected and result.token_ids[-1] == stop and result.finish_reason == "stop"
    assert result.stats.tau > 4  # the oracle's blocks were accepted whole, so the stop fell inside one


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler", "production"])
def test_min_tokens_holds_stops_back_in_plain_and_speculative_decoding_alike(policy):
    """No stop token before min_tokens (vLLM's `min_tokens`): the target's next choice there instead, the same in
    plain and speculative decoding, in a ragged batch."""
    target = tiny_target(eos=7, seed=1)
    prompts = prompts_for(target, [6, 1, 13, 4, 9], seed=1)
    free = [r.token_ids for r in generate_plain(target, prompts, 40, stop_token_ids=set())]
    stop = {free[0][3], free[2][5]}  # tokens the target emits early
    early = [r.token_ids for r in generate_plain(target, prompts, 40, stop_token_ids=stop)]
    held = [r.token_ids for r in generate_plain(target, prompts, 40, stop_token_ids=stop, min_tokens=12)]
    assert any(len(e) < 12 for e in early) and all(len(h) >= 12 for h in held)
    assert all(not stop & set(h[:11]) for h in held)
    assert all(h[: len(e) - 1] == e[:-1] for h, e in zip(held, early) if len(e) < 12)  # the same up to the stop
    oracle = NoisyOracle(target, prompts, block_size=4, noise=0.25, seed=1)
    engine = SpeculativeEngine(target, oracle, oracle_policies(len(prompts))[policy])
    assert [r.token_ids for r in engine.generate(prompts, 40, stop_token_ids=stop, min_tokens=12)] == held
    with pytest.raises(DSparkError, match="min_tokens must be between 0 and"):
        engine.generate(prompts, 8, min_tokens=9)


@pytest.mark.parametrize("limit", [1, 2, 7, 8, 23])
def test_max_new_tokens_exact(limit):
    target = tiny_target(eos=7)
    prompt = prompts_for(target, [6])[0]
    free = generate_plain(target, [prompt], 40, stop_token_ids=set())[0].token_ids
    engine = SpeculativeEngine(target, NoisyOracle(target, [prompt], block_size=7, noise=0.0))
    result = engine.generate([prompt], limit, stop_token_ids=set())[0]
    assert result.token_ids == free[:limit] and result.finish_reason == "length"


def exact_distribution(target, prompt, length, params, banned=()):
    """P(continuation) for every continuation of `length` tokens, by enumeration over a tiny vocabulary (tokens in
    `banned` never drawn)."""
    from dspark.sampling import logits_to_probs

    vocab = target.vocab_size
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))
    full = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    logits = target.forward_sequences(full).logits[:, len(prompt) - 1 : -1]
    logits[..., list(banned)] = float("-inf")
    probs = logits_to_probs(logits, params)
    return seqs, probs.gather(2, seqs[..., None]).squeeze(-1).prod(dim=1)


def sampled_counts(target, drafter, prompt, length, params, n, stops=frozenset()):
    engine = SpeculativeEngine(target, drafter)
    results = engine.generate([prompt] * n, length, params, stop_token_ids=set(stops), min_tokens=length * bool(stops))
    counts = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    return counts, results


def chi_square_p(seqs, probs, counts, n):
    observed, expected = [], []
    small_obs, small_exp = 0, 0.0
    for seq, p in zip(seqs.tolist(), probs.tolist()):
        o = counts.get(tuple(seq), 0)
        if p * n < 5:  # pool rare outcomes so the chi-square approximation holds
            small_obs, small_exp = small_obs + o, small_exp + p * n
        else:
            observed.append(o)
            expected.append(p * n)
    impossible = sum(counts.get(tuple(seq), 0) for seq, p in zip(seqs.tolist(), probs.tolist()) if p == 0)
    assert impossible == 0  # top-k / top-p removed them from the target: they must never be generated
    if small_exp > 0:
        observed.append(small_obs)
        expected.append(small_exp)
    total = sum(expected)
    return chisquare(observed, [e * n / total for e in expected]).pvalue


def peaked_target():
    """A 6-token target sharp enough that a biased sampler shows: near-uniform q would hide any bias."""
    target = tiny_target(vocab_size=6, hidden=16, eos=0, seed=3)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(8)
    return target


SAMPLING_CASES = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=5)]


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=["t1", "t0.7-topk-topp"])
def test_sampling_distribution_equals_target(params):
    target = peaked_target()
    drafter = tiny_drafter(target, block_size=3, markov_rank=4)
    prompt = [1, 2, 3]
    seqs, probs = exact_distribution(target, prompt, 4, params)
    n = 6000
    counts, results = sampled_counts(target, drafter, prompt, 4, params, n)
    accepted = sum(r.stats.tokens - r.stats.rounds for r in results)
    assert accepted > 0.1 * n  # drafts were accepted: the test exercises acceptance, residual and bonus
    assert chi_square_p(seqs, probs, counts, n) > 1e-3


def test_min_tokens_keeps_sampling_on_the_targets_distribution():
    """Stop tokens held back for the whole output: the target's distribution without them, position by position."""
    params = SAMPLING_CASES[0]
    target = peaked_target()
    drafter = tiny_drafter(target, block_size=3, markov_rank=4)
    prompt, stop = [1, 2, 3], 1  # a token the target likes after this prompt
    seqs, probs = exact_distribution(target, prompt, 4, params, banned=[stop])
    plain = exact_distribution(target, prompt, 4, params)[1]
    assert plain[(seqs == stop).any(dim=1)].sum() > 0.2  # without min_tokens, a stop would often come
    n = 4000
    counts, results = sampled_counts(target, drafter, prompt, 4, params, n, stops={stop})
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 0.1 * n
    assert chi_square_p(seqs, probs, counts, n) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler", "production"])
def test_sampling_with_a_noisy_oracle_follows_the_target_in_a_ragged_batch(policy):
    """Two prompts of different lengths in one batch, drafts mostly right: each prompt's continuations follow the
    target's exact distribution under every verification policy, with many drafts accepted."""
    target = peaked_target()
    params = SAMPLING_CASES[1]
    prompts = [[1, 2, 3]] * 3000 + [[4]] * 3000
    engine = SpeculativeEngine(
        target, NoisyOracle(target, prompts, block_size=3, noise=0.3), oracle_policies(len(prompts))[policy]
    )
    results = engine.generate(prompts, 4, params, stop_token_ids=set())
    accepted = sum(r.stats.tokens - r.stats.rounds for r in results)
    assert accepted > 0.5 * len(prompts)
    for prompt, rows in (([1, 2, 3], results[:3000]), ([4], results[3000:])):
        seqs, probs = exact_distribution(target, prompt, 4, params)
        counts = {}
        for r in rows:
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        assert chi_square_p(seqs, probs, counts, len(rows)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft-vocab", "eagle3"])
def test_sampling_distribution_with_other_drafters(kind):
    """The reduced draft vocabulary (probabilities mapped back to target ids) and the EAGLE baseline are lossless."""
    target = peaked_target()
    overrides = (
        dict(draft_vocab_size=4)
        if kind == "draft-vocab"
        else dict(
            architecture="eagle3",
            num_draft_layers=1,
            markov_rank=0,
            enable_confidence_head=False,
            confidence_head_with_markov=False,
        )
    )
    drafter = tiny_drafter(target, block_size=3, **{"markov_rank": 4, **overrides})
    if kind == "draft-vocab":
        drafter.set_draft_vocab(torch.tensor([0, 1, 3, 4]))
    params = SAMPLING_CASES[0]
    seqs, probs = exact_distribution(target, [1, 2, 3], 4, params)
    counts, results = sampled_counts(target, drafter, [1, 2, 3], 4, params, 6000)
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 0.05 * 6000
    assert chi_square_p(seqs, probs, counts, 6000) > 1e-3


@pytest.mark.slow
def test_statistical_test_catches_a_broken_residual(monkeypatch):
    """The same test must fail for a biased sampler: on rejection, sample from q instead of max(0, q - p)."""
    monkeypatch.setattr(verify, "residual_distribution", lambda q, p: q)
    params = SAMPLING_CASES[0]
    target = peaked_target()
    seqs, probs = exact_distribution(target, [1, 2, 3], 4, params)
    for drafter in (tiny_drafter(target, block_size=3, markov_rank=4), NoisyOracle(target, [[1, 2, 3]] * 6000, 3, 0.8)):
        counts, _ = sampled_counts(target, drafter, [1, 2, 3], 4, params, 6000)
        assert chi_square_p(seqs, probs, counts, 6000) < 1e-6


def test_sampling_is_reproducible_with_seed():
    target = tiny_target(eos=7)
    engine = SpeculativeEngine(target, tiny_drafter(target))
    params = SamplingParams(temperature=1.0, seed=42)
    a = engine.generate(prompts_for(target, [4, 7]), 20, params)
    b = engine.generate(prompts_for(target, [4, 7]), 20, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_statistics_are_consistent():
    target = tiny_target(eos=7)
    engine = SpeculativeEngine(target, tiny_drafter(target, block_size=4))
    prompt = prompts_for(target, [5])[0]
    r = engine.generate([prompt], 30, stop_token_ids=set())[0]
    s = r.stats.to_dict()
    hist = s["accepted_length_histogram"]
    assert sum(hist) == s["rounds"]
    assert r.stats.tokens == len(r.token_ids) - 1  # every output token after the first came from exactly one round
    assert sum(k * n for k, n in enumerate(hist)) + s["rounds"] == r.stats.tokens
    assert r.stats.accepted[0] == s["rounds"] - hist[0]  # position 1 accepted in every round that accepted any
    assert r.stats.reached[0] >= s["rounds"] - 1  # and verified in every round but a last one with no room left
    assert len(s["accept_by_position"]) == 4


@pytest.mark.parametrize("preset_gamma", [7, 1], ids=["eagle3", "mtp1"])
def test_eagle_and_mtp_baselines_are_lossless(preset_gamma):
    target = tiny_target(eos=7)
    drafter = tiny_drafter(
        target,
        architecture="eagle3",
        block_size=preset_gamma,
        num_draft_layers=1,
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )
    engine = SpeculativeEngine(target, drafter)
    prompts = prompts_for(target, [6, 1, 13, 4])
    assert [r.token_ids for r in engine.generate(prompts, 30)] == [
        r.token_ids for r in generate_plain(target, prompts, 30)
    ]
    params = SamplingParams(temperature=1.0, seed=9)
    sampled = engine.generate(prompts, 20, params)
    assert all(len(r.token_ids) == 20 or r.token_ids[-1] == 7 for r in sampled)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_other_families_fit_the_design(family):
    """The target adapter and the drafter are family-agnostic: Qwen and Gemma targets decode losslessly the same way
    (Gemma with its sliding-window layers forgetting inside the prompt)."""
    from conftest import tiny_family_target

    sliding = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
    target = tiny_family_target(family, **(sliding if family.startswith("gemma") else {}))
    drafter = tiny_drafter(target, markov_head_type="gated")
    assert hasattr(drafter.layers[0].self_attn, "q_norm")  # the default portable backbone: Qwen3-style layers
    prompts = prompts_for(target, [5, 9, 2])
    expected = [r.token_ids for r in generate_plain(target, prompts, 20)]
    assert [r.token_ids for r in SpeculativeEngine(target, drafter).generate(prompts, 20)] == expected


def test_unsupported_family_is_refused_clearly():
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TinyTokenizer
    from dspark.errors import DSparkError
    from dspark.target import Target

    config = AutoConfig.for_model(
        "mixtral",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    with pytest.raises(DSparkError, match="'mixtral' models are not supported yet"):
        Target(AutoModelForCausalLM.from_config(config).eval(), TinyTokenizer(97, 1), name="tiny-moe", layer_ids=[0, 2])


def test_requests_join_and_leave_between_rounds():
    """Continuous batching: rows admitted while others run, and a cancelled row, leave every other output unchanged;
    each request keeps its own sampling parameters (greedy rows beside sampled ones)."""
    from dspark.decoding.requests import RequestState

    target = tiny_target(eos=7)
    prompts = prompts_for(target, [6, 1, 13, 4, 9])
    engine = SpeculativeEngine(target, NoisyOracle(target, prompts, block_size=4, noise=0.3))
    expected = [r.token_ids for r in generate_plain(target, prompts, 30)]
    sampled = SamplingParams(temperature=1.0, seed=5)
    batch = engine.new_batch()

    def admit(indices, params):
        requests = [RequestState(i, prompts[i], 30, target.stop_token_ids) for i in indices]
        engine.admit(batch, requests, [params] * len(indices), params.generators(len(indices)))
        return requests

    first = admit([0, 1], SamplingParams())
    finished = engine.step(batch) + engine.step(batch)
    later = admit([2, 3], SamplingParams())  # join mid-stream
    noisy = admit([4], sampled)  # a sampled request in the same batch
    finished += engine.step(batch)
    engine.cancel(batch, 3)
    while batch.rows:
        finished += engine.step(batch)
    assert [r.output for r in first + later[:1]] == [expected[0], expected[1], expected[2]]
    assert later[1].finish_reason == "cancelled" and later[1].output == expected[3][: len(later[1].output)]
    assert noisy[0].finished and len(noisy[0].output) > 0
    assert {r.request.index for r in finished} == {0, 1, 2, 3, 4}


def test_without_a_drafter_the_loop_is_plain_decoding():
    target = tiny_target(eos=7)
    prompts = prompts_for(target, [6, 1, 13])
    engine = SpeculativeEngine(target)
    assert [r.token_ids for r in engine.generate(prompts, 25)] == [
        r.token_ids for r in generate_plain(target, prompts, 25)
    ]
    params = SAMPLING_CASES[1]
    peaked = peaked_target()
    seqs, probs = exact_distribution(peaked, [1, 2, 3], 4, params)
    results = SpeculativeEngine(peaked).generate([[1, 2, 3]] * 4000, 4, params, stop_token_ids=set())
    counts = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert chi_square_p(seqs, probs, counts, 4000) > 1e-3


def test_ngram_proposer_is_lossless_and_learns_the_targets_habits():
    from dspark.drafter.ngram import NgramProposer

    target = tiny_target(eos=7)
    prompts = prompts_for(target, [6, 1, 13, 4, 9])
    expected = [r.token_ids for r in generate_plain(target, prompts, 40)]
    seen = NgramProposer([p + e for p, e in zip(prompts, expected)], target.vocab_size, block_size=4)
    results = SpeculativeEngine(target, seen).generate(prompts, 40)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 0.5 * sum(len(e) for e in expected)
    peaked = peaked_target()
    params = SAMPLING_CASES[0]
    habits = [[1, 2, 3] + r.token_ids for r in generate_plain(peaked, [[1, 2, 3]] * 4, 6)]
    seqs, probs = exact_distribution(peaked, [1, 2, 3], 4, params)
    counts, sampled = sampled_counts(peaked, NgramProposer(habits, peaked.vocab_size, 3), [1, 2, 3], 4, params, 6000)
    assert sum(r.stats.tokens - r.stats.rounds for r in sampled) > 0.2 * 6000
    assert chi_square_p(seqs, probs, counts, 6000) > 1e-3


def test_continuous_batching_decodes_each_request_as_if_alone(target):
    """Rows finish at different steps (a wide stop set), stay in the cache until a quarter of the batch is done or
    new requests join, and neither the rows carried nor the compactions change anyone's tokens."""
    prompts = [[1, 5 + i, 9, 3 + 2 * i, 40 + i][: 2 + i % 4] for i in range(11)]
    stop = set(range(20, 34))
    alone = [generate_plain(target, [p], 24, stop_token_ids=stop)[0].token_ids for p in prompts]
    assert len({len(a) for a in alone}) >= 3  # rows really do finish at different steps
    for max_batch in (3, 8):
        together = generate_plain(target, prompts, 24, stop_token_ids=stop, max_batch=max_batch)
        assert [r.token_ids for r in together] == alone


def test_a_requests_time_counts_its_prefill_in_plain_and_speculative_decoding(monkeypatch):
    """Speeds compare plain with speculative decoding (and with other engines, timed from the request): both clocks
    must start before the prompt is read, or the one that starts after it looks faster by the prefill."""
    target = tiny_target(eos=7)
    engine = SpeculativeEngine(target, tiny_drafter(target))
    prefill = target.prefill

    def slow_prefill(*args, **kwargs):
        time.sleep(0.3)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(target, "prefill", slow_prefill)
    prompt = prompts_for(target, [5])
    assert generate_plain(target, prompt, 3)[0].seconds >= 0.3
    assert engine.generate(prompt, 3)[0].seconds >= 0.3
