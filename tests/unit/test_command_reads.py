"""Each command's declaration of the flags it reads (config.commands.READS) is true: it names
real sections and flags, and every flag a command accepts is read by swiftlm's code."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from swiftlm.config.commands import ALL, COMMAND_CONFIGS, READS, UNUSED_FLAGS, read_flags

SOURCE = Path(__file__).resolve().parents[2] / "src" / "swiftlm"
# Where flags are declared, parsed or mapped, not used: a name there is no read.
DECLARING = {"commands.py", "parse.py", "argv.py", "ms_swift.py"}


def code_that_reads() -> str:
    files = [
        p
        for p in SOURCE.rglob("*.py")
        if not (
            p.parent.name == "config" and (p.name in DECLARING or p.name.startswith("sections"))
        )
    ]
    return "\n".join(p.read_text() for p in files)


def test_every_command_declares_each_section_of_its_config_with_real_flags():
    assert set(READS) == set(COMMAND_CONFIGS)
    for command, config in COMMAND_CONFIGS.items():
        sections = {f.name: {g.name for g in fields(f.default_factory)} for f in fields(config)}
        assert set(READS[command]) == set(sections), command
        for section, which in READS[command].items():
            if which != ALL:
                assert set(which) <= sections[section], (command, section)
        every = set().union(*sections.values())
        assert read_flags(command) | UNUSED_FLAGS[command] == every
        assert not read_flags(command) & UNUSED_FLAGS[command]


@pytest.mark.parametrize("command", sorted(READS))
def test_every_flag_a_command_accepts_is_read_by_the_code(command):
    code = code_that_reads()
    unread = [
        flag
        for flag in sorted(read_flags(command))
        if not re.search(rf"\.{flag}\b|[\"']{flag}[\"']", code)
    ]
    assert not unread, f"swiftlm {command} accepts {unread}, which no code reads"
