"""Rewrite the pinned numerics that the tests compare against; the tests themselves never write.

    .venv/bin/python scripts/update_pins.py            # both pin files
    .venv/bin/python scripts/update_pins.py fp32       # tests/integration/pinned_numerics.json
    .venv/bin/python scripts/update_pins.py bf16       # tests/slow/pinned_default_job.json
    .venv/bin/python scripts/update_pins.py fp32 --out /tmp/here.json   # measure, keep the pins

The values are measured exactly as the tests measure them (the same runs, under the suite's one
torch thread and a private data cache). A change that is meant to alter the numbers reruns this
and says why in its commit; `--out` writes elsewhere, to compare two machines' kernels.
"""

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "tests"),
    str(ROOT / "tests" / "integration"),
    str(ROOT / "tests" / "slow"),
]
# The test modules are imported by name from those folders, conftest first: it switches the
# hub off before anything imports transformers.
conftest = importlib.import_module("conftest")
fp32_pins = importlib.import_module("test_pinned_numerics")
bf16_pins = importlib.import_module("test_default_model")


def measure_fp32(work: Path) -> dict:
    model_dir = work / "tiny-llama"
    tokenizer = conftest.build_tokenizer(model_dir)
    conftest.build_tiny_llama(model_dir, vocab_size=len(tokenizer))
    pins = {}
    for name in sorted(fp32_pins.CASES):
        case_dir = work / name
        case_dir.mkdir()
        pins[name] = fp32_pins.run_case(name, model_dir, case_dir)
        print(f"{name}: {pins[name]}", flush=True)
    return pins


def measure_bf16(work: Path) -> dict:
    losses = bf16_pins.default_job_losses(work)
    print(f"default job: {losses}", flush=True)
    return {"losses": losses}


MEASURES = {
    "fp32": (measure_fp32, fp32_pins.EXPECTED),
    "bf16": (measure_bf16, bf16_pins.PINNED_FILE),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="*", help="fp32, bf16 or both (the default)")
    parser.add_argument("--out", type=Path, help="write here instead of the pin file (one kind)")
    args = parser.parse_args(argv)
    which = args.which or sorted(MEASURES)
    if unknown := sorted(set(which) - set(MEASURES)):
        parser.error(f"unknown pins {unknown}; choose from {sorted(MEASURES)}")
    if args.out and len(which) != 1:
        parser.error("--out needs exactly one of fp32, bf16")
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py does for the whole suite
    with tempfile.TemporaryDirectory(prefix="swiftlm-pins-") as tmp:
        os.environ["SWIFTLM_DATA_CACHE"] = str(Path(tmp) / "data-cache")
        for kind in which:
            measure, pin_file = MEASURES[kind]
            work = Path(tmp) / kind
            work.mkdir()
            target = args.out or pin_file
            target.write_text(json.dumps(measure(work), indent=2, sort_keys=True) + "\n")
            print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
