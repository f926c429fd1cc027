"""Suffix decoding alone and beside the DSpark drafter is lossless: greedy output identical to plain decoding under
every verification policy, in ragged batches whose rows join and leave, sampling equal in distribution; the trees
learn what repeats, the global tree grows with served answers unless requests are kept apart."""

import pytest
import torch

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
    assert read_answer_index(tmp_path / "a.safetensors") == (answers, None)
    assert read_answer_index(tmp_path / "a.safetensors", limit=2).answers == answers[:2]
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
    assert not isinstance(load_proposer(f"no-suffix:{ckpt}", target), HybridProposer)  # as --no-suffix
    trees = load_proposer(f"suffix:{ckpt}", target)  # the trees alone, filled from the drafter's answers
    assert isinstance(trees, SuffixProposer) and len(trees.trees.cached_requests) == 10
    assert trees.block_size == hybrid.block_size
    assert len(load_proposer(f"suffix:{ckpt / ANSWER_INDEX}", target).trees.cached_requests) == 10
    notes = ckpt / "notes.safetensors"
    notes.write_text("mine")
    code, err = run_cli(capsys, "suffix-index", "--data", data, "--out", notes)
    assert code == 2 and "did not write" in err and notes.read_text() == "mine"
    code, err = run_cli(capsys, "generate", "hi", "--model", folder, "--drafter", f"suffix:{notes}")
    assert code == 2 and "is not a suffix answer index" in err
    prompt = [5, 9, 13]
    expected = generate_plain(target, [prompt], 20)[0].token_ids
    assert SpeculativeEngine(target, hybrid).generate([prompt], 20)[0].token_ids == expected


def test_a_token_only_proposer_is_profiled_for_the_scheduler():
    """The cost table times a round's drafting for proposers that read no features (suffix decoding alone)."""
    from dspark.scheduling.profile import profile_target

    target = tiny_target()
    table = profile_target(target, (1, 2, 4), repeats=1, drafter=SuffixProposer(target.vocab_size, block_size=4))
    assert table.meta["draft"][0]["ms"] >= 0


def test_platt_scaling_recovers_a_known_miscalibration():
    from dspark.scheduling.calibration import fit_platt

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, generator=g) * 2
    labels = torch.rand(4000, generator=g) < torch.sigmoid(2 * logits - 1)
    a, b = fit_platt(logits, labels)
    assert abs(a - 2) < 0.2 and abs(b + 1) < 0.2
    assert fit_platt(logits[:3], labels[:3], prior=1e6) == pytest.approx((1.0, 0.0), abs=1e-3)  # too few: identity


def test_the_trees_confidences_are_calibrated_per_match_length_and_position(tmp_path):
    """A calibration stored in the answer index rescales each drafted position's logit by its match group's and
    position's (a, b); one of the wrong shape is refused by name."""
    from dspark.drafter import load_proposer
    from dspark.drafter.suffix import MATCH_BUCKETS, match_bucket
    from dspark.errors import DSparkError
    from dspark.sampling import SamplingParams

    target = tiny_target()
    answers = [[5, 6, 7, 8, 9, 10, 11, 12]] * 3
    table = torch.tensor([1.0, 0.0]).repeat(len(MATCH_BUCKETS), 4, 1)
    table[:, :, 0] = torch.arange(1, len(MATCH_BUCKETS) + 1)[:, None].float()  # a = group number
    table[:, :, 1] = torch.arange(4).float()  # b = position
    raw, calibrated = tmp_path / "raw.safetensors", tmp_path / "calibrated.safetensors"
    write_answer_index(answers, raw)
    write_answer_index(answers, calibrated, table)
    proposals = []
    for index in (raw, calibrated):
        trees = load_proposer(f"suffix:{index}", target)
        cache = trees.new_cache(1)
        trees.extend_context(cache, None, torch.tensor([3]), torch.tensor([[5, 6, 7]]))
        proposals.append((trees.propose(cache, torch.zeros(1, dtype=torch.long), SamplingParams()), cache))
    (before, _), (after, cache) = proposals
    n, group = int(after.lengths[0]), match_bucket(cache.match_lengths[0])
    assert n == 4 and cache.match_lengths[0] >= 2
    expected = (group + 1) * before.confidence_logits[0, :n] + torch.arange(n)
    assert torch.allclose(after.confidence_logits[0, :n], expected)
    with pytest.raises(DSparkError, match="rebuild the answer index"):
        SuffixProposer(target.vocab_size, 7, answers, calibration=table)


def test_each_match_group_and_position_gets_its_own_scaling_where_it_has_the_positions():
    from dspark.bench.suffix import MIN_FIT, fit_tree_calibration
    from dspark.drafter.suffix import MATCH_BUCKETS

    g = torch.Generator().manual_seed(0)
    drafted = []
    for _ in range(3000):  # long matches (group 4), position 1: survive far more often than the logit says
        logit = float(torch.randn(1, generator=g))
        drafted.append((0, 20, logit, bool(torch.rand(1, generator=g) < torch.sigmoid(torch.tensor(2 * logit + 2)))))
    drafted += [(2, 1, 0.0, True)] * (MIN_FIT - 1)  # too few positions in group 0: it stays as it is
    table = fit_tree_calibration(drafted, 3)
    assert table.shape == (len(MATCH_BUCKETS), 3, 2)
    assert abs(table[4, 0, 0] - 2) < 0.3 and abs(table[4, 0, 1] - 2) < 0.3
    assert torch.equal(table[4, 1], table[4, 0])  # a position without data takes its group's scaling
    assert torch.equal(table[0], torch.tensor([1.0, 0.0]).repeat(3, 1))


def test_suffix_index_calibrates_and_the_bench_reports_tau_memory_and_calibration(tiny_run, saved_drafter, capsys):
    """`dspark suffix-index` fits the calibration on held-out answers it does not hold; `dspark bench suffix` walks
    held-out answers against trees of growing size and writes τ, memory and the calibration before and after."""
    import json

    from conftest import run_cli
    from dspark.drafter.suffix import ANSWER_INDEX, MATCH_BUCKETS

    def hybrid_block(path):
        return json.loads((path / "config.json").read_text())["drafter"]["block_size"]

    folder, data = tiny_run
    _, ckpt, _ = saved_drafter
    index_args = ["suffix-index", "--data", data, "--out", ckpt, "--count", 20, "--model", folder, "--calibrate", 200]
    code, err = run_cli(capsys, *index_args, "--holdout", 0.3)
    assert code == 0 and "calibrated the trees' probabilities on" in err, err
    table = read_answer_index(ckpt / ANSWER_INDEX).calibration
    assert table is not None and table.shape == (len(MATCH_BUCKETS), hybrid_block(ckpt), 2)
    out = ckpt.parent / "bench-suffix"
    args = ["bench", "suffix", "--model", folder, "--data", data, "--holdout", 0.3, "--sizes", 0, 10, "--out", out]
    code, err = run_cli(capsys, *args, "--block-size", 4)
    assert code == 0, err
    run = json.loads((out / "suffix.json").read_text())
    assert [r["answers"] for r in run["sizes"]] == [0, 10] and all(r["tau"] >= 1 for r in run["sizes"])
    assert set(run["calibration"]) == {"raw", "calibrated"} and run["calibration"]["raw"]["positions"] > 0
    assert "| position 1 |" in (out / "suffix.md").read_text() and (out / "suffix.png").stat().st_size > 1000
    code, err = run_cli(capsys, *index_args, "--holdout", 1.5)
    assert code == 2 and "--holdout" in err


def test_suffix_decoding_reads_the_tokens_of_rounds_that_drafted_nothing():
    """A scheduler may skip drafting for a round; the tokens of such rounds reach the proposer later, and suffix
    decoding alone asks the target for no features."""
    from dspark.decoding.policy import FixedLength

    class EveryOtherRound(FixedLength):
        rounds = 0

        def drafts(self, rows):
            self.rounds += 1
            return self.rounds % 2 == 0

    target, prompts, expected = target_and_answers()
    for proposer in (SuffixProposer(target.vocab_size, block_size=4), tiny_drafter(target, block_size=4)):
        results = SpeculativeEngine(target, proposer, EveryOtherRound()).generate(prompts, 40)
        assert [r.token_ids for r in results] == expected
        assert all(0 < r.stats.drafted_rounds < r.stats.rounds for r in results)
