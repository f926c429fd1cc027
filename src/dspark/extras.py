"""Optional dependencies, imported where they are needed, each refused with the command that installs it."""

from __future__ import annotations

from dspark.errors import DSparkError


def pyplot():
    """matplotlib's pyplot on the file-only backend (plots of benchmarks and calibration): the `bench` extra."""
    try:
        import matplotlib
    except ImportError:
        raise DSparkError("plots need matplotlib: pip install 'dspark[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chitchat_conversations_file():
    """The chitchat-dataset conversations the `chat` prompt source draws on: the `prompts` extra."""
    try:
        import chitchat_dataset
    except ImportError:
        raise DSparkError(
            "the chat prompt source needs chitchat-dataset: pip install 'dspark[prompts]', or leave chat out of --mix"
        ) from None
    from pathlib import Path

    return Path(chitchat_dataset.__file__).parent / "dataset.json"
