"""docs/architecture.md stays the picture of the code: its package table names exactly the
packages under src/swiftlm, and its import layers are the import-linter contract's."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGE_ROW = re.compile(r"^\| `(\w+)/` \|", re.MULTILINE)


def test_the_package_table_names_every_package_and_no_other():
    documented = set(PACKAGE_ROW.findall(DOC))
    source = ROOT / "src" / "swiftlm"
    packages = {p.parent.name for p in source.glob("*/__init__.py")}
    data_folders = {p.name for p in source.iterdir() if p.is_dir() and p.name == "assets"}
    assert documented == packages | data_folders, (
        f"undocumented: {sorted(packages | data_folders - documented)}; "
        f"documented but missing: {sorted(documented - packages - data_folders)}"
    )


def test_the_import_layers_are_the_contract():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = contract["contracts"][0]["layers"]
    expected = [
        " | ".join(p.removeprefix("swiftlm.") for p in layer.split(" | ")) for layer in layers
    ]
    block = DOC.split("## Import layers", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    assert block.split("\n")[1:-1] == expected
