"""docs/bad-input.md is generated from the tests' bad_input markers and must be current."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def table_script():
    spec = importlib.util.spec_from_file_location(
        "bad_input_table", ROOT / "scripts" / "bad_input_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_lists_every_marked_test_and_is_current():
    script = table_script()
    rows = script.rows()
    assert len(rows) >= 10
    for _, _, test_id in rows:
        path, name = test_id.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), test_id
    assert script.main(["--check"]) == 0, "run: python scripts/bad_input_table.py"
