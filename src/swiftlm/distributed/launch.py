"""Start a command under torchrun when more than one process is asked for.

`swiftlm sft ... --nproc_per_node 2` re-runs itself as
`torchrun --nproc_per_node 2 ... -m swiftlm sft ...`; the workers see LOCAL_RANK and do not
launch again. torchrun runs through `swiftlm.distributed.torchrun`, which turns a failure of
the workers into one message and the failing rank's exit code. `torchrun -m swiftlm sft ...`
works directly too.
"""

import os
import subprocess
import sys
import time

from swiftlm.config.sections import DistArguments


def launched_by_torchrun() -> bool:
    """torchrun sets these for every worker (checked without importing torch: the launcher
    process only re-executes itself)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def wants_launch(args: DistArguments) -> bool:
    return (args.nproc_per_node > 1 or args.nnodes > 1) and not launched_by_torchrun()


def torchrun_command(args: DistArguments, command: str, argv: list[str]) -> list[str]:
    launcher = [
        sys.executable,
        "-m",
        "swiftlm.distributed.torchrun",
        f"--nproc_per_node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--node_rank={args.node_rank}",
        f"--master_addr={args.master_addr}",
        f"--master_port={args.master_port}",
        f"--max_restarts={args.max_restarts}",
    ]
    return [*launcher, "-m", "swiftlm", command, *argv]


def with_fixed_output_dir(argv: list[str], output_dir: str | None) -> list[str]:
    """Every worker (and every restart) must write to the same run directory, so a default
    one (which has a timestamp) is chosen once here."""
    if output_dir is not None:
        return argv
    return [*argv, "--output_dir", f"output/run-{time.strftime('%Y%m%d-%H%M%S')}"]


def launch(args: DistArguments, command: str, argv: list[str], output_dir: str | None) -> int:
    """Run the command under torchrun and return its exit code (on failure: the first failing
    rank's, whose error torchrun.py has printed)."""
    cmd = torchrun_command(args, command, with_fixed_output_dir(argv, output_dir))
    print("Launching: torchrun " + " ".join(cmd[3:]), flush=True)
    return subprocess.call(cmd)
