"""The config section of `swiftlm plan`: the hardware to plan for and where the plan goes.
The job itself (model, --train_type, --max_length, batch, checkpointing, --nnodes) uses the
training command's own flags. Same conventions as `config/sections.py`."""

from dataclasses import dataclass

from swiftlm.config.checks import above, check_fields
from swiftlm.config.sections import doc


@dataclass
class PlanArguments:
    devices: str = doc(
        "The devices of one node: COUNTxDEVICE, e.g. 8xH100, 4xA100-80G, 2xcpu (this machine's "
        "CPUs, measured once by a probe). Known devices: H100, H100-PCIE, H200, A100-80G, "
        "A100-40G, L40S, A10G, L4, RTX4090, V100, MI300X, cpu.",
        default="cpu",
    )
    memory_per_device: float | None = doc(
        "Memory budget per device in GiB, instead of the device's own (e.g. 2.5 to ask what "
        "fits in 2.5 GiB per process).",
        default=None,
    )
    output_json: str | None = doc(
        "Also write the plan as JSON to this file (`-`: print JSON instead of the table).",
        default=None,
    )

    def __post_init__(self):
        check_fields(self, memory_per_device=above(0, note="GiB"))
