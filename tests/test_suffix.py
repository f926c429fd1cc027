"""Suffix decoding alone and beside the DSpark drafter is lossless: greedy output identical to plain decoding under
every verification policy, in ragged batches whose rows join and leave, sampling equal in distribution; the trees
learn what repeats, the global tree grows with served answers unless requests are kept apart."""

import pytest

from conftest import tiny_drafter, tiny_target
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.plain import generate_plain
from dspark.drafter.hybrid import HybridProposer
from dspark.drafter.suffix import SuffixProposer, read_answer_index, write_answer_index
from test_engine import (
    SAMPLING_CASES,
    chi_square_p,
    exact_distribution,
    oracle_policies,
    peaked_target,
    prompts_for,
    sampled_counts,
)


def target_and_answers(seed=0):
    target = tiny_target(eos=7, seed=seed)
    prompts = prompts_for(target, [6, 1, 13, 4, 9], seed=seed)
    expected = [r.token_ids for r in generate_plain(target, prompts, 40)]
    return target, prompts, expected


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler", "production"])
def test_suffix_decoding_is_lossless_and_learns_the_targets_answers(policy):
    target, prompts, expected = target_and_answers()
    empty = SuffixProposer(target.vocab_size, block_size=4)
    engine = SpeculativeEngine(target, empty, oracle_policies(len(prompts))[policy])
    assert [r.token_ids for r in engine.generate(prompts, 40)] == expected
    learnt = SuffixProposer(target.vocab_size, block_size=4, answers=expected)
    results = SpeculativeEngine(target, learnt, oracle_policies(len(prompts))[policy]).generate(prompts, 40)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 0.5 * sum(map(len, expected))


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler", "production"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_the_hybrid_is_lossless_and_uses_both_sources(policy, gamma):
    """The tree knows the answers to some prompts, not the others': rows of one batch take different sources."""
    target, prompts, expected = target_and_answers(seed=gamma)
    tree = SuffixProposer(target.vocab_size, block_size=gamma, answers=expected[:2])
    hybrid = HybridProposer(tiny_drafter(target, block_size=gamma), tree)
    results = SpeculativeEngine(target, hybrid, oracle_policies(len(prompts))[policy]).generate(prompts, 40)
    assert [r.token_ids for r in results] == expected
    assert hybrid.rows_by_source["suffix"] > 0 and hybrid.rows_by_source["drafter"] > 0


def test_the_hybrid_skips_the_drafter_where_every_row_takes_the_tree(monkeypatch):
    target, prompts, expected = target_and_answers()
    drafter = tiny_drafter(target, block_size=4)
    calls = []
    propose = drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda *a, **k: calls.append(1) or propose(*a, **k))
    hybrid = HybridProposer(drafter, SuffixProposer(target.vocab_size, block_size=4, answers=expected))
    results = SpeculativeEngine(target, hybrid).generate(prompts[:1], 40)
    assert results[0].token_ids == expected[0] and len(calls) < results[0].stats.rounds


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=["t1", "t0.7-topk-topp"])
def test_the_hybrid_samples_the_targets_distribution(params):
    target = peaked_target()
    habits = [r.token_ids for r in generate_plain(target, [[1, 2, 3]] * 4, 6)]
    tree = SuffixProposer(target.vocab_size, block_size=3, answers=habits)
    hybrid = HybridProposer(tiny_drafter(target, block_size=3, markov_rank=4), tree, min_expected=0.2)
    seqs, probs = exact_distribution(target, [1, 2, 3], 4, params)
    counts, results = sampled_counts(target, hybrid, [1, 2, 3], 4, params, 6000)
    assert sum(r.stats.tokens - r.stats.rounds for r in results) > 0.1 * 6000
    assert hybrid.rows_by_source["suffix"] > 0
    assert chi_square_p(seqs, probs, counts, 6000) > 1e-3


@pytest.mark.parametrize("isolate", [False, True])
def test_served_answers_join_the_global_tree_unless_requests_are_kept_apart(isolate):
    from dspark.decoding.requests import RequestState
    from dspark.sampling import SamplingParams

    target, prompts, expected = target_and_answers()
    tree = SuffixProposer(target.vocab_size, block_size=4, isolate=isolate)
    engine = SpeculativeEngine(target, tree)

    def serve(i):  # as the server does: one batch, rows joining and leaving
        batch = engine.new_batch()
        request = RequestState(i, prompts[0], 40, target.stop_token_ids)
        engine.admit(batch, [request], [SamplingParams()], SamplingParams().generators(1))
        rounds = 0
        while batch.rows:
            engine.step(batch)
            rounds += 1
        assert request.output == expected[0]
        return rounds

    first, second = serve(0), serve(1)
    assert (second == first) if isolate else (second < first)
    assert len(tree.trees.active_requests) == 0  # every finished row released its prompt tree


def test_an_answer_index_round_trips(tmp_path):
    answers = [[5, 6, 7], [1], [9, 9, 9, 9]]
    write_answer_index(answers, tmp_path / "a.safetensors")
    assert read_answer_index(tmp_path / "a.safetensors") == answers
    assert read_answer_index(tmp_path / "a.safetensors", limit=2) == answers[:2]
    (tmp_path / "bad.safetensors").write_text("not an index")
    with pytest.raises(Exception, match="not a suffix answer index"):
        read_answer_index(tmp_path / "bad.safetensors")


def test_a_row_verifies_no_more_drafts_than_the_tree_has():
    """Proposal.lengths caps what a row verifies: positions the tree did not draft are never verified."""
    target, prompts, expected = target_and_answers()
    tree = SuffixProposer(target.vocab_size, block_size=6, answers=expected)
    speculate = tree.trees.speculate

    def two(*args, **kwargs):
        draft = speculate(*args, **kwargs)
        draft.token_ids, draft.probs = draft.token_ids[:2], draft.probs[:2]
        return draft

    tree.trees.speculate = two
    results = SpeculativeEngine(target, tree).generate(prompts, 40)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.verified_tokens <= 2 * r.stats.rounds and not any(r.stats.accepted_hist[3:]) for r in results)
    assert sum(r.stats.accepted_hist[2] for r in results) > 0


def test_a_drafter_with_an_answer_index_drafts_beside_suffix_decoding_by_default(tiny_run, saved_drafter, capsys):
    from conftest import run_cli
    from dspark.drafter import load_proposer
    from dspark.drafter.suffix import ANSWER_INDEX

    _, data = tiny_run
    folder, ckpt, target = saved_drafter
    assert not isinstance(load_proposer(ckpt, target), HybridProposer)  # no index: the drafter alone
    code, err = run_cli(capsys, "suffix-index", "--data", data, "--out", ckpt, "--count", 10)
    assert code == 0 and (ckpt / ANSWER_INDEX).is_file(), err
    hybrid = load_proposer(ckpt, target)
    assert isinstance(hybrid, HybridProposer) and len(hybrid.tree.trees.cached_requests) == 10
    assert not isinstance(load_proposer(ckpt, target, suffix=False), HybridProposer)
    assert isinstance(load_proposer("suffix", target), SuffixProposer)
    notes = ckpt / "notes.safetensors"
    notes.write_text("mine")
    code, err = run_cli(capsys, "suffix-index", "--data", data, "--out", notes)
    assert code == 2 and "did not write" in err and notes.read_text() == "mine"
    prompt = [5, 9, 13]
    expected = generate_plain(target, [prompt], 20)[0].token_ids
    assert SpeculativeEngine(target, hybrid).generate([prompt], 20)[0].token_ids == expected


def test_a_token_only_proposer_is_profiled_for_the_scheduler():
    """The cost table times a round's drafting for proposers that read no features (suffix decoding alone)."""
    from dspark.scheduling.profile import profile_target

    target = tiny_target()
    table = profile_target(target, (1, 2, 4), repeats=1, drafter=SuffixProposer(target.vocab_size, block_size=4))
    assert table.meta["draft"][0]["ms"] >= 0
