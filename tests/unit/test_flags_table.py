"""docs/flags.md is generated from the config sections' help text and must be current."""

import re
from pathlib import Path

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def table_script():
    return load_script("flags_table")


def test_the_page_lists_every_flag_of_every_command_and_is_current():
    script = table_script()
    page = script.render()
    documented = set(re.findall(r"^\| `--(\w+)` \|", page, flags=re.MULTILINE))
    for command, sections in script.command_sections().items():
        for fields in sections.values():
            for f in fields:
                assert f.name in documented, f"--{f.name} of swiftlm {command}"
                assert f.metadata.get("help"), f"--{f.name} has no help text"
    assert script.main(["--check"]) == 0, "run: python scripts/flags_table.py"
