"""The config section of what a training run shows about itself while it runs: the profiler
window, gradient histograms, spike detection and the live dashboard. Same conventions as
`config/sections.py`: field names are the flag names, each field's `help` is its `--help` text.

The step-time breakdown, per-layer gradient norms and the data-health summary are always on
(their cost is measured in `benchmarks/observability.py`); these flags choose the extras.
"""

import re
from dataclasses import dataclass

from swiftlm.config.checks import above, at_least, check_fields, custom, within
from swiftlm.config.sections import doc

_STEP_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_step_range(text: str) -> tuple[int, int]:
    """`5-8` -> (5, 8); `6` -> (6, 6). Raises ValueError on anything else."""
    match = _STEP_RANGE.match(text)
    if not match:
        raise ValueError(text)
    first = int(match.group(1))
    last = int(match.group(2) or first)
    if first < 1 or last < first:
        raise ValueError(text)
    return first, last


def _is_step_range(text: str) -> bool:
    try:
        parse_step_range(text)
    except ValueError:
        return False
    return True


@dataclass
class MonitorArguments:
    profile: bool = doc(
        "Record a PyTorch profiler trace over --profile_steps: <run>/profile/trace.json "
        "(open in https://ui.perfetto.dev or chrome://tracing), the top operators printed; on "
        "CUDA also a memory snapshot (profile/memory_snapshot.pickle).",
        default=False,
    )
    profile_steps: str = doc(
        "Optimizer steps the profiler records, FIRST-LAST (e.g. 5-8) or one step.",
        default="5-8",
    )
    histogram_steps: int = doc(
        "Write per-layer gradient histograms (TensorBoard and the report) every N optimizer "
        "steps, and at step 1. 0 disables them. Per-layer gradient norms are logged at every "
        "--logging_steps regardless.",
        default=50,
    )
    spike_factor: float = doc(
        "Flag a loss or gradient norm above this many times its running median (last 50 "
        "steps) as a spike, in the log, anomalies.jsonl and the report.",
        default=3.0,
    )
    dashboard: bool = doc(
        "Serve the live run page (the report, updating as steps are logged) on "
        "http://127.0.0.1:--dashboard_port while the run trains.",
        default=False,
    )
    dashboard_port: int = doc("Port of --dashboard (0: a free port, printed at start).", default=0)

    def __post_init__(self):
        check_fields(
            self,
            profile_steps=custom(
                _is_step_range,
                "--{flag} {value}: give FIRST-LAST optimizer steps (e.g. 5-8) or one step "
                "(e.g. 6), counting from 1",
            ),
            histogram_steps=at_least(0, note="0 disables histograms"),
            spike_factor=above(1),
            dashboard_port=within(0, 65535),
        )
