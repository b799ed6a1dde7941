"""The monitor section's flags: the profiler window's spelling and the limits of the others."""

import pytest

from swiftlm.config.commands import TrainConfig
from swiftlm.config.parse import parse_config
from swiftlm.errors import ConfigError
from swiftlm.monitor.config import parse_step_range


def test_step_ranges():
    assert parse_step_range("5-8") == (5, 8)
    assert parse_step_range(" 6 ") == (6, 6)
    for bad in ("0-3", "8-5", "a-b", "5-", "-3", "1,2"):
        with pytest.raises(ValueError):
            parse_step_range(bad)


@pytest.mark.bad_input(
    input="`--profile_steps 8-5` (or any window that is not FIRST-LAST optimizer steps from 1), "
    "`--spike_factor 1`, `--histogram_steps -1`",
    outcome="Error naming the flag, the value and the form it takes, before anything loads",
)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile_steps", "8-5"], "--profile_steps 8-5: give FIRST-LAST optimizer steps"),
        (["--spike_factor", "1"], "--spike_factor"),
        (["--histogram_steps", "-1"], "--histogram_steps"),
        (["--dashboard_port", "70000"], "--dashboard_port"),
    ],
)
def test_bad_monitor_flags_are_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(TrainConfig, argv, "sft")
