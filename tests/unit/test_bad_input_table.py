"""docs/bad-input.md is generated from the tests' bad_input markers and must be current."""

from pathlib import Path

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def table_script():
    return load_script("bad_input_table")


def test_the_page_lists_every_marked_test_and_is_current():
    script = table_script()
    rows = script.rows()
    assert len(rows) >= 10
    for _, _, test_id in rows:
        path, name = test_id.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), test_id
    assert script.main(["--check"]) == 0, "run: python scripts/bad_input_table.py"
