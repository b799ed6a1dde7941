"""Start a command under torchrun when more than one process is asked for.

`swiftlm sft ... --nproc_per_node 2` re-runs itself as
`torchrun --nproc_per_node 2 ... -m swiftlm sft ...`; the workers see LOCAL_RANK and do not
launch again. `--nnodes MIN:MAX` makes an elastic job: torchrun's c10d rendezvous instead of
a fixed rank-0 node, and the workers always continue the run in --output_dir. torchrun runs
through `swiftlm.distributed.torchrun`, which turns a failure of the workers into one message
and the failing rank's exit code. `torchrun -m swiftlm sft ...` works directly too.
"""

import hashlib
import os
import sys
import time

from swiftlm.distributed.config import DistArguments, node_range
from swiftlm.distributed.failures import ELASTIC_ENV
from swiftlm.distributed.signals import call_forwarding_signals


def launched_by_torchrun() -> bool:
    """torchrun sets these for every worker (checked without importing torch: the launcher
    process only re-executes itself)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def wants_launch(args: DistArguments) -> bool:
    most_nodes = node_range(args.nnodes)[1]
    return (args.nproc_per_node > 1 or most_nodes > 1) and not launched_by_torchrun()


def torchrun_command(
    args: DistArguments, command: str, argv: list[str], output_dir: str | None = None
) -> list[str]:
    launcher = [
        sys.executable,
        "-m",
        "swiftlm.distributed.torchrun",
        f"--nproc_per_node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        *(rendezvous_args(args, output_dir) if args.elastic else static_args(args)),
        f"--max_restarts={args.restarts}",
    ]
    return [*launcher, "-m", "swiftlm", command, *argv]


def static_args(args: DistArguments) -> list[str]:
    """A fixed set of nodes: node N of --nnodes, rank 0's node at --master_addr/port."""
    return [
        f"--node_rank={args.node_rank}",
        f"--master_addr={args.master_addr}",
        f"--master_port={args.master_port}",
    ]


def rendezvous_args(args: DistArguments, output_dir: str | None) -> list[str]:
    """An elastic job: every node's agent meets at the c10d rendezvous, which numbers the
    nodes itself (no --node_rank) each time one leaves or joins."""
    conf = [f"--rdzv_conf={args.rdzv_conf}"] if args.rdzv_conf else []
    return [
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={args.rdzv_endpoint or f'{args.master_addr}:{args.master_port}'}",
        f"--rdzv_id={args.rdzv_id or default_rdzv_id(output_dir)}",
        *conf,
    ]


def default_rdzv_id(output_dir: str | None) -> str:
    """The same on every node that names the same --output_dir; two jobs that share an
    endpoint but write to different runs do not meet."""
    digest = hashlib.sha1(str(output_dir).encode()).hexdigest()[:12]
    return f"swiftlm-{digest}"


def elastic_argv(argv: list[str]) -> list[str]:
    """The workers of an elastic job continue the run in --output_dir at every membership
    change (each new set of workers runs this same command line): `--resume_from_checkpoint
    auto` unless the flag is given (the rules refuse any other value for an elastic job)."""
    given = any(arg.split("=")[0] == "--resume_from_checkpoint" for arg in argv)
    return argv if given else [*argv, "--resume_from_checkpoint", "auto"]


def worker_environment(args: DistArguments) -> dict[str, str]:
    """The launcher's environment. An elastic job asks torchrun for a fresh store per set of
    workers, hosted by worker rank 0 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), rather than the
    agent's shared one: its keys outlive a set of workers, and the agents' restart counts,
    which `env.attempt_store` tells attempts apart by, differ once nodes have joined."""
    env = dict(os.environ)
    if args.elastic:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env[ELASTIC_ENV] = "1"  # a worker whose peer is lost says so in a line (`failures`)
    return env


def with_fixed_output_dir(argv: list[str], output_dir: str | None) -> list[str]:
    """Every worker (and every restart) must write to the same run directory, so a default
    one (which has a timestamp) is chosen once here."""
    if output_dir is not None:
        return argv
    return [*argv, "--output_dir", f"output/run-{time.strftime('%Y%m%d-%H%M%S')}"]


def launch(args: DistArguments, command: str, argv: list[str], output_dir: str | None) -> int:
    """Run the command under torchrun and return its exit code (on failure: the first failing
    rank's, whose error torchrun.py has printed)."""
    argv = with_fixed_output_dir(argv, output_dir)
    if args.elastic:
        argv = elastic_argv(argv)
    cmd = torchrun_command(args, command, argv, output_dir)
    print("Launching: torchrun " + " ".join(cmd[3:]), flush=True)
    if args.elastic:
        low, high = node_range(args.nnodes)
        print(
            f"elastic job: {low} to {high} nodes of {args.nproc_per_node} processes; the "
            f"workers restart at each membership change and resume from the newest checkpoint "
            f"with the same global batch (--max_restarts {args.restarts}: each node that leaves "
            "costs one restart)",
            flush=True,
        )
    return call_forwarding_signals(cmd, env=worker_environment(args))  # SIGTERM/SIGUSR1 too
