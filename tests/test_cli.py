"""The command line on the real target: what a user types, its output and exit codes. The commands run in this
process (`run_cli_output`: the interpreter and torch are loaded once); one test runs `dspark` as its own process."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import run_cli_output
from dspark.drafter import DSparkConfig, new_drafter

pytestmark = pytest.mark.real


@pytest.fixture
def dspark(capsys):
    def run(*args):
        code, out, err = run_cli_output(capsys, *args)
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


@pytest.fixture(scope="module")
def untrained_drafter(real_target, tmp_path_factory):
    path = tmp_path_factory.mktemp("drafter") / "d"
    new_drafter(real_target, DSparkConfig(num_draft_layers=1, markov_rank=16)).save(path, real_target.identity())
    return path


@pytest.mark.slow
def test_generate_json(real_target, dspark):
    proc = dspark("generate", "Write a haiku about the sea", "--max-new-tokens", "8", "--json", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["new_tokens"] == 8 and out["text"] and out["tokens_per_s"] > 0 and len(out["token_ids"]) == 8


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_speculative_generate_is_identical_to_plain_on_the_real_target(untrained_drafter, dtype, dspark):
    proc = dspark(
        "generate",
        "List three prime numbers.",
        "--max-new-tokens",
        "24",
        "--drafter",
        str(untrained_drafter),
        "--compare-plain",
        "--json",
        "--dtype",
        dtype,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["identical_to_plain"] is True and len(out["accept_by_position"]) == 7
    assert round(out["tau"] * out["rounds"]) == out["new_tokens"] - 1  # each token after the first from one round
    assert out["speedup"] > 0


@pytest.mark.slow
@pytest.mark.real
def test_the_shipped_drafter_in_bfloat16_gives_plain_output_token_for_token(real_target):
    """bfloat16 runs batch-invariant: speculative output equals plain output on real prompts, near ties included."""
    from dspark.assets import eval_prompts, shipped_drafter
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.plain import generate_plain
    from dspark.drafter import load_drafter
    from dspark.target import Target

    target = Target.load("smollm2-135m-instruct", dtype="bfloat16")
    drafter = load_drafter(shipped_drafter("smollm2-135m-instruct"), target)
    # each set's shortest of its first eight: bfloat16 prompts are read slowly where it is emulated (AVX2-only CPUs)
    shortest = [min(eval_prompts(name, 8), key=len) for name in ("gsm8k", "mt-bench", "humaneval")]
    prompts = [target.encode_chat(p) for p in shortest]
    plain = [r.token_ids for r in generate_plain(target, prompts, 32)]
    alone = [SpeculativeEngine(target, drafter).generate([p], 32)[0].token_ids for p in prompts]
    batched = [r.token_ids for r in SpeculativeEngine(target, drafter).generate(prompts, 32)]
    assert alone == plain and batched == plain


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--model", "no-such-model"], "unknown model"),
        (["generate", "hi", "--max-new-tokens", "0"], "must be a positive integer"),
        (["generate", "hi", "--compare-plain"], "add --drafter"),
        (["generate", "hi", "--drafter", "/nonexistent"], "not a drafter checkpoint"),
        (["generate", "hi", "--temperature", "-1"], "temperature must be"),
        (["generate", "hi", "--dtype", "bfloat16", "--compile"], "--compile runs int4 targets"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args, message, dspark):
    proc = dspark(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_models_lists_the_default_target(real_target):
    """`dspark` as its own process, as a user starts it."""
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "models", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0
    rows = json.loads(proc.stdout)
    assert rows[0]["name"] == "smollm2-135m-instruct" and rows[0]["provisioned"] is True


@pytest.mark.slow
def test_demo_runs_side_by_side(untrained_drafter, dspark):
    proc = dspark(
        "demo",
        "--drafter",
        str(untrained_drafter),
        "--datasets",
        "gsm8k",
        "--max-new-tokens",
        "12",
        "--dtype",
        "float32",
    )
    assert proc.returncode == 0, proc.stderr
    assert "outputs IDENTICAL" in proc.stdout and "speed-up" in proc.stdout and "mean τ" in proc.stdout


@pytest.mark.slow
def test_shipped_drafter_demo(tmp_path, dspark):
    """The README's main command on the drafter that ships: small, calibrated, lossless, and it accepts drafts.

    The scheduler is given a fixed cost table (float32 forwards over 1-8 tokens as measured on one 2-core AVX2 EPYC),
    not this machine's: on a machine where two tokens already cost twice one, it rightly verifies nothing, and
    acceptance would not be tested."""
    from dspark.assets import shipped_drafter
    from dspark.scheduling.profile import CostTable

    path = shipped_drafter("smollm2-135m-instruct")
    assert (path / "model.safetensors").stat().st_size <= 40e6
    assert (path / "MODEL_CARD.md").is_file() and (path / "calibration.json").is_file()
    CostTable([1, 2, 4, 8], [47.0, 63.0, 73.0, 93.0]).save(tmp_path / "costs.json")
    proc = dspark(
        "demo",
        "--datasets",
        "gsm8k",
        "--max-new-tokens",
        "32",
        "--dtype",
        "float32",
        "--cost-table",
        tmp_path / "costs.json",
    )
    assert proc.returncode == 0, proc.stderr
    assert "prefix scheduler" in proc.stdout and "identical outputs: 1/1" in proc.stdout
    tau = float(proc.stdout.split("mean τ ")[1].split(";")[0])
    assert tau > 1.2, proc.stdout
    refused = dspark("demo", "--fixed", "--cost-table", tmp_path / "costs.json")
    assert refused.returncode == 2 and "--fixed turns it off" in refused.stderr, refused.stderr


def test_a_server_leaves_one_core_to_its_http_side():
    import argparse

    import torch

    from dspark.cli.args import keep_a_core_for_serving

    default = argparse.Namespace(threads=0)
    keep_a_core_for_serving(default)
    assert default.threads == max(1, torch.get_num_threads() - 1)
    chosen = argparse.Namespace(threads=3)
    keep_a_core_for_serving(chosen)
    assert chosen.threads == 3
