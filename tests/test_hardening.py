"""Bad input and data safety: no command destroys a user's files, runs code from a file, or answers bad input with a
traceback. Each case uses real files on disk and the real command line (in-process, so a case costs milliseconds
unless it needs a model); every refusal is exit code 2 with a message that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import refused, run_cli, tiny_target
from dspark.drafter import load_drafter
from dspark.errors import DSparkError
from dspark.fsutil import atomic_dir, read_jsonl, recover_dir


# ---- regenerate never truncates what it did not write -------------------------------------------------------------
def test_regenerate_refuses_the_prompts_file_as_out(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "world"}\n')
    before = prompts.read_bytes()
    refused(capsys, "is the prompts file", "regenerate", "--prompts", prompts, "--out", prompts)
    # through another name too: its first line is not a regenerated record
    link = tmp_path / "same.jsonl"
    shutil.copy(prompts, link)
    refused(capsys, "not a regenerated record", "regenerate", "--prompts", prompts, "--out", link)
    assert prompts.read_bytes() == before and link.read_bytes() == before


def test_regenerate_keeps_every_record_around_a_corrupt_line(tmp_path, capsys):
    out = tmp_path / "regen.jsonl"
    good = {"id": "a", "messages": [], "assistant_token_ids": [[1]]}
    out.write_text(json.dumps(good) + "\n{corrupt\n" + json.dumps(dict(good, id="b")) + "\n")
    before = out.read_bytes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    refused(capsys, "regen.jsonl:2: not valid JSON", "regenerate", "--prompts", prompts, "--out", out)
    assert out.read_bytes() == before


def test_duplicate_prompt_ids_are_refused_before_any_answer(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "x", "prompt": "a"}\n{"id": "y", "prompt": "b"}\n{"id": "x", "prompt": "c"}\n')
    out = tmp_path / "out.jsonl"
    refused(capsys, "id 'x' appears twice (lines 1 and 3)", "regenerate", "--prompts", prompts, "--out", out)
    assert not out.exists()


# ---- export ---------------------------------------------------------------------------------------------------------
def test_export_carries_calibration_and_never_clobbers(saved_drafter, tmp_path, capsys):
    folder, ckpt, _ = saved_drafter
    code, err = run_cli(capsys, "export", ckpt, tmp_path / "out", "--model", folder, "--dtype", "bfloat16")
    assert code == 0, err
    assert (tmp_path / "out" / "calibration.json").is_file() and (tmp_path / "out" / "MODEL_CARD.md").is_file()
    # onto itself: refused, nothing deleted
    refused(capsys, "is the input folder", "export", ckpt, ckpt, "--model", folder)
    assert (ckpt / "MODEL_CARD.md").is_file() and (ckpt / "calibration.json").is_file()
    # onto a file: refused, the file intact
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    refused(capsys, "is a file", "export", ckpt, victim, "--model", folder)
    assert victim.read_text() == "keep me"
    # onto a folder with content: refused unless --overwrite
    refused(capsys, "--overwrite", "export", ckpt, tmp_path / "out", "--model", folder)
    code, err = run_cli(capsys, "export", ckpt, tmp_path / "out", "--model", folder, "--overwrite")
    assert code == 0, err


# ---- checkpoints that were damaged or edited ------------------------------------------------------------------------
def edit_config(ckpt: Path, **drafter_fields):
    meta = json.loads((ckpt / "config.json").read_text())
    meta["drafter"].update(drafter_fields)
    (ckpt / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, message", [
    (lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:300]), "damaged or truncated"),
    (lambda c: (c / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda c: edit_config(c, markov_rank="8"), "markov_rank must be int"),
    (lambda c: edit_config(c, enable_confidence_head=1), "enable_confidence_head must be bool"),
    (lambda c: edit_config(c, markov_rank=16), "saved with markov_rank=8"),
    (lambda c: edit_config(c, block_size=9), "saved with block_size=5"),
    (lambda c: (c / "config.json").write_text(json.dumps(dict(json.loads((c / "config.json").read_text()),
                                                             format_version=99))), "format_version 99"),
])
def test_a_damaged_checkpoint_is_refused_with_its_cause(saved_drafter, damage, message):
    _, ckpt, target = saved_drafter
    damage(ckpt)
    with pytest.raises(DSparkError, match=message):
        load_drafter(ckpt, target)


def test_weights_that_do_not_fit_the_config_are_refused(saved_drafter):
    _, ckpt, target = saved_drafter
    state = load_file(str(ckpt / "model.safetensors"))
    state["markov_head.markov_w1.weight"] = torch.zeros(64, 3)  # metadata dropped, shapes wrong
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(DSparkError, match="wrong shapes"):
        load_drafter(ckpt, target)


def test_fingerprint_sees_the_weights_not_only_the_shape():
    from dspark import models

    a, b = tiny_target(seed=0), tiny_target(seed=0)
    assert a.fingerprint == b.fingerprint
    with torch.no_grad():
        b.model.model.layers[1].mlp.down_proj.weight.add_(0.01)  # a "fine-tune"
    assert models.fingerprint(b.config, b.tokenizer, b.model) != a.fingerprint
    assert models.fingerprint(a.config, a.tokenizer, a.model.to(torch.bfloat16)) == a.fingerprint  # precision-free


# ---- atomic folders ---------------------------------------------------------------------------------------------------
def test_a_replacement_killed_half_way_is_undone(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "w").write_text("old")
    path.rename(tmp_path / ".ckpt.old-1234")  # the old folder moved aside, then the process was killed
    recover_dir(path)
    assert (path / "w").read_text() == "old"
    with atomic_dir(path) as tmp:
        (tmp / "w").write_text("new")
    assert (path / "w").read_text() == "new" and not list(tmp_path.glob(".ckpt.*"))


# ---- training: resume in place, no code from files --------------------------------------------------------------
def test_resume_trains_in_the_given_folder_and_refuses_changes(tiny_run, tmp_path, capsys):
    folder, data = tiny_run
    common = ["--data", data, "--model", folder, "--target-dtype", "float32", "--num-draft-layers", "1",
              "--markov-rank", "8", "--block-size", "4", "--batch-size", "4", "--target-layer-ids", "0,2",
              "--mask-token-id", "63", "--no-bf16", "--quiet", "--save-every", "2", "--eval-every", "100"]
    a = tmp_path / "a"
    assert run_cli(capsys, "train", "--out", a, "--max-steps", "2", *common)[0] == 0
    b = tmp_path / "b"
    shutil.copytree(a, b)
    before = (a / "checkpoint" / "model.safetensors").read_bytes()
    refused(capsys, "--lr would change what it learns", "train", "--out", b, "--resume", "--lr", "0.5")
    refused(capsys, "already holds a run", "train", "--out", b, *common)
    # Precision is how it computes, not what it learns: a run moved to a CPU where bfloat16 is fast (or slow) may
    # change it on resume, and the checkpoint records the change.
    code, err = run_cli(capsys, "train", "--out", b, "--resume", "--max-steps", "3", "--bf16", "--quiet")
    assert code == 0, err
    assert json.loads((b / "checkpoint" / "trainer_state.json").read_text())["train_config"]["bf16"] is True
    code, err = run_cli(capsys, "train", "--out", b, "--resume", "--max-steps", "4", "--quiet")
    assert code == 0, err
    state = json.loads((b / "checkpoint" / "trainer_state.json").read_text())
    assert state["loop"]["step"] == 4 and state["train_config"]["bf16"] is True
    assert (a / "checkpoint" / "model.safetensors").read_bytes() == before  # the run it was copied from: untouched


def test_a_crafted_trainer_state_runs_no_code(tiny_run, tmp_path, capsys):
    folder, data = tiny_run
    out = tmp_path / "run"
    common = ["--data", data, "--model", folder, "--target-dtype", "float32", "--num-draft-layers", "1",
              "--markov-rank", "8", "--block-size", "4", "--target-layer-ids", "0,2", "--mask-token-id", "63",
              "--no-bf16", "--quiet"]
    assert run_cli(capsys, "train", "--out", out, "--max-steps", "1", *common)[0] == 0
    state_file = out / "checkpoint" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    marker = tmp_path / "pwned"
    state["python_rng"] = f"().__class__.__base__.__subclasses__() or open({str(marker)!r}, 'w')"
    state_file.write_text(json.dumps(state))
    refused(capsys, "python_rng is not a random-generator state", "train", "--out", out, "--resume", "--max-steps", "2")
    assert not marker.exists()


def test_training_data_is_checked_against_the_target(tiny_run, tmp_path, capsys):
    folder, data = tiny_run
    records = read_jsonl(data)
    common = ["--model", folder, "--target-dtype", "float32", "--num-draft-layers", "1", "--markov-rank", "8",
              "--block-size", "4", "--target-layer-ids", "0,2", "--mask-token-id", "63", "--max-steps", "1", "--quiet"]
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("".join(json.dumps(dict(r, target=dict(r["target"], fingerprint="0" * 16))) + "\n" for r in records))
    refused(capsys, "--allow-foreign-data", "train", "--data", foreign, "--out", tmp_path / "f", *common)
    assert not (tmp_path / "f").exists()  # a run that failed on its inputs leaves no folder behind
    wide = tmp_path / "wide.jsonl"
    wide.write_text("".join(json.dumps(dict(r, assistant_token_ids=[[5, 9999]])) + "\n" for r in records))
    refused(capsys, "token id 9999, outside the target's vocabulary", "train", "--data", wide, "--out", tmp_path / "w",
            *common)
    texty = tmp_path / "texty.jsonl"
    texty.write_text("".join(json.dumps(dict(r, assistant_token_ids=[["5"]])) + "\n" for r in records))
    refused(capsys, "lists of non-negative integers", "train", "--data", texty, "--out", tmp_path / "t", *common)


# ---- reading text ---------------------------------------------------------------------------------------------------
def test_jsonl_records_may_hold_line_separators(tmp_path):
    from dspark.training.data import read_records

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "one\u2028two\u2029three\x85four"}, ensure_ascii=False) + "\n"
                    + json.dumps({"prompt": "next"}) + "\n", encoding="utf-8")
    records = read_records(path)
    assert len(records) == 2 and records[0]["messages"][0]["content"] == "one\u2028two\u2029three\x85four"


def test_non_utf8_prompts_name_the_line(tmp_path):
    from dspark.training.data import read_records

    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(DSparkError, match=r"p.txt:2: not UTF-8"):
        read_records(path)


def test_a_prompt_longer_than_the_context_window_is_refused():
    from dspark.decoding.plain import generate_plain

    target = tiny_target()  # max_position_embeddings 1024
    with pytest.raises(DSparkError, match="1100 tokens, but the model's context window is 1024"):
        generate_plain(target, [[3] * 1100], 4)
    near = generate_plain(target, [[3] * 1020], 50, stop_token_ids=set())[0]
    assert len(near.token_ids) == 4 and near.finish_reason == "length"  # capped at the window, not past it


# ---- arguments, checked before any model loads ----------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--temperature", "nan"], "must be a finite number"),
    (["generate", "hi", "--threads", "-2"], "--threads: must be between 0"),
    (["generate", "hi", "--threads", "100000"], "--threads: must be between 0"),
    (["generate", "hi", "--top-k", "-1"], "must be 0 or more"),
    (["profile", "--out", "x.json", "--token-counts", "0"], "must be a positive integer"),
    (["train", "--out", "r", "--data", "d.jsonl", "--lr", "nan"], "must be a finite number"),
    (["regenerate", "--prompts", "p.jsonl", "--out", "o.jsonl", "--limit", "-3"], "must be 0 or more"),
    (["generate", "hi", "--drafter", "d", "--schedule", "--verify-length", "3"], "not allowed with argument"),
    (["generate", "hi", "--schedule"], "add --drafter"),
    (["bench", "--name", "../../x"], "must be a plain name"),
])
def test_bad_arguments_exit_2_before_loading(args, message, capsys):
    refused(capsys, message, *args)


def test_paths_of_the_wrong_kind_are_refused_before_loading(tmp_path, capsys):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    refused(capsys, "is a folder; give a file path", "profile", "--out", folder)
    afile = tmp_path / "a-file"
    afile.write_text("x")
    refused(capsys, "is a file; give a folder path", "bench", "--out", afile)
    refused(capsys, "is a file, so nothing can be created under it", "profile", "--out", afile / "costs.json")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    if not torch.cuda.is_available():
        refused(capsys, "--device cuda:0: this machine has no CUDA GPU", "train", "--out", tmp_path / "r", "--data",
                data, "--device", "cuda:0")
        refused(capsys, "--device cuda: this machine has no CUDA GPU", "regenerate", "--prompts", data, "--out",
                tmp_path / "o.jsonl", "--device", "cuda")
    refused(capsys, "is not a device name", "regenerate", "--prompts", data, "--out", tmp_path / "o.jsonl",
            "--device", "gpu0")


def test_prompt_mix_needs_its_evaluation_sets(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(capsys, "holds no evaluation sets", "prompts", "--out", tmp_path / "p.jsonl", "--count", "10",
            "--eval-dir", empty)
    refused(capsys, "holds no evaluation sets", "prompts", "--out", tmp_path / "p.jsonl", "--count", "10",
            "--eval-dir", tmp_path / "missing")
    refused(capsys, "SOURCE=NUMBER", "prompts", "--out", tmp_path / "p.jsonl", "--mix", "chat")
    refused(capsys, "unknown prompt source(s) poetry", "prompts", "--out", tmp_path / "p.jsonl", "--mix", "poetry=1")
    assert not (tmp_path / "p.jsonl").exists()
