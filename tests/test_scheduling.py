"""Confidence-scheduled verification: cost table, Algorithm 1, its losslessness (paper Appendix A), calibration."""

import math

import pytest
import torch

from conftest import tiny_drafter, tiny_target
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.plain import generate_plain
from dspark.decoding.policy import FixedLength
from dspark.decoding.requests import RequestState
from dspark.decoding.verify import verify_sampling
from dspark.errors import DSparkError
from dspark.sampling import SamplingParams
from dspark.scheduling.calibration import Rounds, auroc, ece, fit_sts, report
from dspark.scheduling.planner import PrefixScheduler, ProductionScheduler
from dspark.scheduling.profile import CostTable, fit_monotone, interleaved_median_ms, profile_target

APPENDIX_A = CostTable([1, 2, 3], [1000.0, 2000.0, 1000 / 0.45])  # SPS(1)=1.0, SPS(2)=0.5, SPS(3)=0.45


def logit(p):
    return math.log(p / (1 - p)) if 0 < p < 1 else (-30.0 if p == 0 else 30.0)


def test_cost_table_interpolates_and_round_trips(tmp_path):
    table = CostTable([8, 1, 4], [80.0, 50.0, 60.0], {"dtype": "float32"})
    assert table.token_counts == [1, 4, 8]
    assert table.step_time(2) == pytest.approx(50 + 10 / 3)
    assert table.step_time(16) == pytest.approx(160.0)  # proportional beyond the table
    table.save(tmp_path / "c.json")
    again = CostTable.load(tmp_path / "c.json")
    assert again.step_time_ms == table.step_time_ms and again.meta["dtype"] == "float32"
    with pytest.raises(DSparkError, match="not a cost table"):
        (tmp_path / "bad.json").write_text("{}")
        CostTable.load(tmp_path / "bad.json")


def test_algorithm_1_by_hand():
    flat = CostTable([1, 16], [10.0, 10.0])  # verifying is free: admit everything that has any chance
    conf = torch.tensor([[logit(0.9), logit(0.5), logit(0.01)]])
    assert PrefixScheduler(flat).lengths(conf, 3, 1).tolist() == [3]
    steep = CostTable([1, 2, 3, 4], [10.0, 20.0, 30.0, 40.0])  # each token costs a full step: never worth it
    assert PrefixScheduler(steep).lengths(conf, 3, 1).tolist() == [0]
    mild = CostTable([1, 2, 3, 4], [10.0, 11.0, 12.0, 20.0])
    # Θ0 = 1·100; Θ1 = 1.9·90.9 = 172.7; Θ2 = 2.35·83.3 = 195.8; Θ3 = 2.3545·50 = 117.7 -> ℓ = 2
    assert PrefixScheduler(mild).lengths(conf, 3, 1).tolist() == [2]
    # two requests compete for the budget: the more confident one gets the tokens first
    two = torch.tensor([[logit(0.95), logit(0.9)], [logit(0.3), logit(0.3)]])
    assert PrefixScheduler(CostTable([2, 3, 4, 5, 6], [10.0, 10.5, 11.0, 20.0, 30.0])).lengths(two, 2, 2).tolist() == [
        2,
        0,
    ]
    with pytest.raises(DSparkError, match="confidence head"):
        PrefixScheduler(flat).lengths(None, 3, 1)


def test_the_scheduler_plans_with_the_cost_of_the_batch_shape_and_of_drafting():
    """With a grid of batch shapes a round costs what its rows carry (a ragged verify: the mean tokens per row),
    plus the drafter's share, which it pays whatever it verifies."""
    grid = [
        {"batch_size": rows, "tokens_per_row": width, "ms": 10.0 + 1.0 * rows * (width - 1)}
        for rows in (1, 4)
        for width in (1, 2, 3, 4)
    ]
    shaped = CostTable([1, 16], [10.0, 10.5], {"grid": grid})
    assert shaped.has_shapes and not CostTable([1, 16], [10.0, 10.5]).has_shapes
    assert shaped.shape_time(1, 2) == pytest.approx(11.0) and shaped.shape_time(4, 2.5) == pytest.approx(16.0)
    assert shaped.shape_time(2, 2) == pytest.approx(10.0 + 1.0 * 2)  # between profiled batch sizes: linear in rows
    assert shaped.shape_time(8, 2) == pytest.approx(2 * (10.0 + 1.0 * 4))  # beyond: proportional
    assert shaped.draft_time(4) == 0 and shaped.round_time(4, 2) == pytest.approx(14.0)
    # the grid's timings per batch size are read as the closest curve that never falls: a step stays a step
    assert fit_monotone([(1, 10.0), (2, 12.0), (3, 12.0), (4, 20.0)]) == [(1, 10.0), (2, 12.0), (3, 12.0), (4, 20.0)]
    assert fit_monotone([(2, 10.0), (1, 14.0), (3, 12.0)]) == [(1, 12.0), (2, 12.0), (3, 12.0)]
    noisy = CostTable([1], [10.0], {"grid": [dict(g, ms=g["ms"] * (1.4 if g == grid[0] else 1)) for g in grid]})
    assert noisy.shape_time(1, 1) <= noisy.shape_time(1, 2) <= noisy.shape_time(1, 4)  # raw points: 14, 11, ...
    stepped = [
        {"batch_size": rows, "tokens_per_row": w, "ms": 20.0 + (5 if w > 1 else 0) + (10 if w > 4 else 0)}
        for rows in (1, 4)
        for w in range(1, 9)
    ]
    steps = CostTable([1], [20.0], {"grid": stepped})
    assert steps.shape_time(1, 2) == steps.shape_time(1, 4) == 25.0 < steps.shape_time(1, 5) == 35.0
    assert steps.shape_time(1, 1.5) == pytest.approx(22.5) and steps.shape_time(1, 16) == pytest.approx(70.0)
    drafting = CostTable(
        [1, 16], [10.0, 10.5], {"grid": grid, "draft": [{"batch_size": 1, "ms": 4.0}, {"batch_size": 4, "ms": 10.0}]}
    )
    assert drafting.draft_time(2) == pytest.approx(6.0) and drafting.round_time(4, 2) == pytest.approx(24.0)
    # per request: the confident rows verify deep, the doubtful ones nothing (a ragged verify costs its tokens)
    conf = torch.tensor([[logit(0.95), logit(0.9), logit(0.9)]] * 2 + [[logit(0.05), logit(0.05), logit(0.05)]] * 2)
    assert PrefixScheduler(shaped).lengths(conf, 3, 4).tolist() == [3, 3, 0, 0]
    # a draft whose survival is 0.3 does not pay for a 4 ms verify of a 10 ms step ...
    one = torch.tensor([[logit(0.3)]])
    single = [{"batch_size": b, "tokens_per_row": w, "ms": b * (6.0 + 4.0 * w)} for b in (1, 2) for w in (1, 2)]
    assert PrefixScheduler(CostTable([1], [10.0], {"grid": single})).lengths(one, 1, 1).tolist() == [0]
    # ... but it does once the round also pays 20 ms of drafting, spent whether or not it verifies
    paid = {"grid": single, "draft": [{"batch_size": 1, "ms": 20.0}]}
    assert PrefixScheduler(CostTable([1], [10.0], paid)).lengths(one, 1, 1).tolist() == [1]


def test_a_scheduler_skips_drafting_where_it_does_not_pay():
    """Drafting costs little beside one row's forward and much beside sixteen rows' (as on a CPU): with drafts that
    survive 70 % of the time, one row drafts and sixteen verify their anchors alone, drafting after probe_every rounds
    to renew the estimate, then after twice as many each time it still does not pay, up to max_probe_gap."""
    grid = [{"batch_size": b, "tokens_per_row": w, "ms": 10.0 * b + 1.0 * b * (w - 1)} for b in (1, 16) for w in (1, 4)]
    draft = [{"batch_size": 1, "ms": 2.0}, {"batch_size": 16, "ms": 300.0}]
    scheduler = PrefixScheduler(CostTable([1], [10.0], {"grid": grid, "draft": draft}), probe_every=4, max_probe_gap=16)
    assert scheduler.drafts(16)  # nothing seen yet: draft
    scheduler.lengths(torch.full((16, 3), logit(0.7)), 3, 16)  # survival 0.7, 0.49, 0.34
    assert scheduler.drafting_pays(1) and not scheduler.drafting_pays(16)
    drafted = []
    for i in range(1, 61):
        if scheduler.drafts(16):
            drafted.append(i)
            scheduler.lengths(torch.full((16, 3), logit(0.7)), 3, 16)
    assert drafted == [4, 12, 28, 44, 60]  # probes after 4, 8, 16, 16 and 16 rounds
    assert len(scheduler.recent) == 1  # a probe's estimates replace the older ones
    assert scheduler.drafts(1)  # a round where drafting pays: probes are due after probe_every rounds again
    assert [scheduler.drafts(16) for _ in range(4)] == [False, False, False, True]
    # drafts that always survive pay even at sixteen rows
    scheduler.recent.clear()
    scheduler.lengths(torch.full((16, 3), 30.0), 3, 16)
    assert scheduler.drafting_pays(16)


def test_an_engine_that_skips_drafting_is_lossless_and_saves_the_proposals():
    target = tiny_target(eos=7)
    drafter = tiny_drafter(target, block_size=4)
    dear = CostTable([1], [10.0], {"grid": [{"batch_size": 1, "tokens_per_row": w, "ms": 10.0} for w in (1, 5)]})
    dear.meta["draft"] = [{"batch_size": 1, "ms": 1000.0}]  # no draft pays for a 1000 ms proposal
    engine = SpeculativeEngine(target, drafter, PrefixScheduler(dear, probe_every=5, max_probe_gap=5))
    proposals = []
    propose = drafter.propose
    drafter.propose = lambda *a, **k: proposals.append(1) or propose(*a, **k)
    prompt = [9, 10, 11, 12]
    [result] = engine.generate([prompt], 30)
    assert result.token_ids == generate_plain(target, [prompt], 30)[0].token_ids
    assert result.stats.drafted_rounds == len(proposals) == math.ceil(result.stats.rounds / 5)
    # fixed ℓ = 0 never drafts at all
    proposals.clear()
    [result] = SpeculativeEngine(target, drafter, FixedLength(0)).generate([prompt], 30)
    assert result.stats.drafted_rounds == len(proposals) == 0 < result.stats.rounds


@pytest.mark.parametrize("kind", [PrefixScheduler, ProductionScheduler])
def test_requests_joining_an_idle_engine_start_the_scheduler_afresh(kind):
    """A request whose drafts were rejected must not stop the next one from drafting: when requests join an engine
    with no rows, the scheduler forgets earlier estimates, probe gaps and budgets, and the first round drafts."""
    target = tiny_target(eos=7)
    drafter = tiny_drafter(target, block_size=4)
    grid = [{"batch_size": 1, "tokens_per_row": w, "ms": 10.0} for w in (1, 5)]
    scheduler = kind(CostTable([1], [10.0], {"grid": grid, "draft": [{"batch_size": 1, "ms": 5.0}]}), max_probe_gap=64)
    engine = SpeculativeEngine(target, drafter, scheduler)
    scheduler.lengths(torch.full((1, 4), -30.0), 4, 1)  # a request whose drafts never survive ...
    scheduler.probe_gap, scheduler.skipped = 64, 10  # ... after rounds that stopped drafting
    assert not scheduler.drafts(1)
    batch = engine.new_batch()
    engine.admit(batch, [RequestState(0, [9, 10, 11], 8, {7}, None)], [SamplingParams()], [None])
    assert not scheduler.recent and scheduler.probe_gap == scheduler.probe_every and scheduler.drafts(1)
    scheduler.lengths(torch.full((1, 4), -30.0), 4, 1)
    engine.admit(batch, [RequestState(1, [9, 10], 8, {7}, None)], [SamplingParams()], [None])  # joins a busy batch
    assert len(scheduler.recent) == 1


def appendix_a_first_token(scheduler_lengths, n=20000, seed=0):
    """Monte Carlo of the paper's Appendix A: target (0.7, 0.3), draft (0.5, 0.5), a1 = 0.8, c2 depends on x1."""
    g = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(torch.tensor([0.5, 0.5]), n, replacement=True, generator=g)
    c2 = torch.where(x1 == 0, 0.9, 0.0)
    conf = torch.stack([torch.full((n,), logit(0.8)), torch.tensor([logit(float(c)) for c in c2])], dim=1)
    ell = scheduler_lengths(conf)
    q_logits = torch.log(torch.tensor([0.7, 0.3])).expand(n, 3, 2)
    p = torch.full((n, 2, 2), 0.5)
    tokens = torch.stack([x1, torch.zeros_like(x1)], dim=1)
    gens = SamplingParams(temperature=1.0, seed=seed).generators(n)
    accepted, nxt = verify_sampling(q_logits, p, tokens, ell, SamplingParams(temperature=1.0), gens)
    first = torch.where(accepted > 0, x1, nxt)
    return float((first == 0).float().mean())


def test_early_stop_keeps_the_target_distribution():
    scheduler = PrefixScheduler(APPENDIX_A)
    share_a = appendix_a_first_token(lambda conf: torch.cat([scheduler.lengths(c[None], 2, 1) for c in conf]))
    assert share_a == pytest.approx(0.7, abs=0.015)


def test_a_search_without_early_stop_is_biased():
    """What the early stop prevents: choosing ℓ by the global argmax of Θ lets x1 decide its own admission."""

    def global_argmax(conf):
        out = []
        for c in conf:
            a = torch.sigmoid(c).cumprod(0).tolist()
            steps_per_s = [1000 / APPENDIX_A.step_time(n) for n in (1, 2, 3)]
            thetas = [1.0 * steps_per_s[0], (1 + a[0]) * steps_per_s[1], (1 + a[0] + a[1]) * steps_per_s[2]]
            out.append(max(range(3), key=lambda i: thetas[i]))
        return torch.tensor(out)

    assert appendix_a_first_token(global_argmax) == pytest.approx(0.85, abs=0.015)


def test_scheduled_engine_is_lossless():
    target = tiny_target(eos=7)
    engine = SpeculativeEngine(
        target, tiny_drafter(target, block_size=6), PrefixScheduler(CostTable([1, 4, 8], [10.0, 11.0, 14.0]))
    )
    prompts = [[9, 10, 11, 12], [40, 41], [60, 61, 62, 63, 64, 65]]
    results = engine.generate(prompts, 25)
    assert [r.token_ids for r in results] == [r.token_ids for r in generate_plain(target, prompts, 25)]
    assert any(r.stats.verified_tokens < 6 * r.stats.rounds for r in results)  # it really shortened some rounds


def test_sts_fixes_overconfidence():
    torch.manual_seed(0)
    n, gamma = 4000, 3
    true_p = torch.rand(n, gamma) * 0.9 + 0.05
    accepted = torch.rand(n, gamma) < true_p
    survived = accepted.long().cumprod(dim=1).bool()
    logits = torch.log(true_p / (1 - true_p)) * 3  # three times too sharp
    rounds = Rounds(logits, survived, torch.ones(n, gamma, dtype=torch.bool))
    temps = fit_sts(rounds)
    assert temps[0] == pytest.approx(3.0, abs=0.5) and temps[1] == pytest.approx(3.0, abs=1.0), temps
    rows = report(rounds, temps)
    assert all(r["ece_after"] < r["ece_before"] for r in rows)
    assert rows[0]["auroc"] > 0.6 and rows[0]["brier_after"] < rows[0]["brier_before"]
    assert ece(torch.tensor([0.9, 0.9]), torch.tensor([1, 1])) == pytest.approx(0.1)
    assert auroc(torch.tensor([0.9, 0.1]), torch.tensor([1, 0])) == 1.0


def test_profile_measures_a_real_forward():
    table = profile_target(tiny_target(), token_counts=(1, 4), context=16, repeats=2)
    assert table.token_counts == [1, 4] and all(t > 0 for t in table.step_time_ms)


def test_profiling_interleaves_what_it_times():
    """Each pass times every run once, in turn, so load from elsewhere falls on all of them alike."""
    calls: list[str] = []
    medians = interleaved_median_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] * 4 and set(medians) == {"a", "b"}  # one warm-up pass, then 3 timed


def test_profile_calibrate_and_scheduled_generate_from_the_command_line(tiny_run, tmp_path, capsys):
    import json

    from conftest import run_cli_output
    from dspark.target import Target

    folder, _ = tiny_run
    target = Target.load(str(folder))
    tiny_drafter(target, block_size=4, mask_token_id=63).save(tmp_path / "d", target.identity())
    (tmp_path / "p.txt").write_text("t5 t6 t7\nt9 t10\nt20 t21 t22 t23\n")

    def run(*args):
        code, out, err = run_cli_output(capsys, *args, "--dtype", "float32")
        assert code == 0, err
        return out

    run(
        "profile",
        "--model",
        str(folder),
        "--out",
        str(tmp_path / "costs.json"),
        "--token-counts",
        "1",
        "2",
        "5",
        "--context",
        "8",
        "--repeats",
        "1",
    )
    run(
        "calibrate",
        "--model",
        str(folder),
        "--drafter",
        str(tmp_path / "d"),
        "--data",
        str(tmp_path / "p.txt"),
        "--max-new-tokens",
        "16",
        "--out",
        str(tmp_path / "calib.json"),
        "--plot",
        str(tmp_path / "calib.png"),
    )
    calib = json.loads((tmp_path / "calib.json").read_text())
    assert len(calib["sts_temperatures"]) == 4 and calib["rounds"] > 0 and (tmp_path / "calib.png").exists()
    out = json.loads(
        run(
            "generate",
            "t5 t6",
            "--model",
            str(folder),
            "--drafter",
            str(tmp_path / "d"),
            "--max-new-tokens",
            "16",
            "--cost-table",
            str(tmp_path / "costs.json"),
            "--calibration",
            str(tmp_path / "calib.json"),
            "--json",
            "--compare-plain",
        )
    )
    assert out["identical_to_plain"] is True


def test_production_budget_is_a_global_argmax_used_two_steps_later():
    from dspark.scheduling.planner import ProductionScheduler

    # Jagged curve: the 2nd extra token costs much, the 3rd and 4th nothing more. Algorithm 1 stops at the bump;
    # the global argmax looks past it.
    jagged = CostTable([1, 2, 3, 4, 5], [10.0, 10.0, 16.0, 16.0, 16.0])
    sure = torch.full((1, 4), 6.0)  # confidences ~0.998: every draft worth verifying if the cost allows
    assert PrefixScheduler(jagged).lengths(sure, 4, 1).tolist() == [1]
    production = ProductionScheduler(jagged)
    assert production.budget(torch.sigmoid(sure).cumprod(1)) == 4
    unsure = torch.full((1, 4), -6.0)
    steps = [production.lengths(c, 4, 1).tolist() for c in (sure, unsure, unsure, unsure, unsure)]
    # steps 1-2: no history yet (one draft each); step 3 spends step 1's budget (4); steps 4-5 those of the unsure
    # steps 2-3 (1: on this curve a second token is free)
    assert steps == [[1], [1], [4], [1], [1]]


class DraftsEveryThirdRound(FixedLength):
    """Drafts (and verifies two drafts) in every third round; `eager` drafts in the others too but verifies none, so
    the drafter reads every round's token as it comes."""

    def __init__(self, eager: bool):
        super().__init__(2)
        self.eager, self.round = eager, 0

    def drafts(self, rows: int) -> bool:
        self.round += 1
        return self.eager or self.round % 3 == 1

    def lengths(self, confidence_logits, gamma: int, batch: int) -> torch.Tensor:
        return torch.full((batch,), 2 if self.round % 3 == 1 else 0, dtype=torch.long)


def test_rounds_that_do_not_draft_leave_their_tokens_for_the_drafter_to_read_in_one_call():
    """The drafter reads the tokens of rounds that skip drafting when it next drafts, in one call: its proposals are
    those of a drafter that read every token as it came, in fewer calls, and the rows that join and leave between
    rounds keep their own context."""
    target = tiny_target(eos=7)
    drafter = tiny_drafter(target, block_size=4)
    extend, propose = drafter.extend_context, drafter.propose
    prompts = [[9, 10, 11, 12], [3, 4], [20, 21, 22, 23, 24, 25]]
    outputs, proposals, calls = {}, {}, {}
    for eager in (True, False):
        proposals[eager], calls[eager] = [], 0

        def recorded(*args, eager=eager, **kwargs):
            proposal = propose(*args, **kwargs)
            proposals[eager].append(proposal.tokens)
            return proposal

        def counted(*args, eager=eager, **kwargs):
            calls[eager] += 1
            return extend(*args, **kwargs)

        drafter.propose, drafter.extend_context = recorded, counted
        engine = SpeculativeEngine(target, drafter, DraftsEveryThirdRound(eager))
        outputs[eager] = [r.token_ids for r in engine.generate(prompts, 24)]
    assert outputs[False] == outputs[True] == [r.token_ids for r in generate_plain(target, prompts, 24)]
    read_as_they_came = proposals[True][::3]
    assert len(read_as_they_came) == len(proposals[False]) > 3
    assert all(torch.equal(a, b) for a, b in zip(read_as_they_came, proposals[False]))
    assert calls[False] < calls[True]
