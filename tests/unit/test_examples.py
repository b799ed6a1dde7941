"""Every example recipe parses, and its first line is the command that runs it."""

from pathlib import Path

import pytest

from swiftlm.config import TrainConfig, parse_config

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_parses_and_names_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# swiftlm ") and path.as_posix().endswith(first.split()[3])
    cfg = parse_config(TrainConfig, [str(path)], "swiftlm")
    assert cfg.output.output_dir


def test_examples_exist():
    assert len(EXAMPLES) >= 2
