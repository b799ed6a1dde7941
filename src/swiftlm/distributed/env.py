"""The process group and this process's place in it.

Under torchrun every process reads RANK / WORLD_SIZE / LOCAL_RANK from the environment; a
plain `swiftlm sft` is a world of one and initializes torch.distributed only for an engine
that needs a process group even alone (DeepSpeed: `init_single_process_group`).
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from swiftlm.distributed.failures import install_crash_hook
from swiftlm.distributed.launch import launched_by_torchrun


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, value: float) -> float:
        """Sum a Python number over all ranks (float64 so token counts stay exact)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
        dist.all_reduce(tensor)
        return float(tensor.item())

    def all_reduce_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a float64 tensor over all ranks, on the collective device, without reading it
        back to the host (the caller reads what it needs, once)."""
        values = values.to(device=collective_device(), dtype=torch.float64, copy=True)
        if self.distributed:
            dist.all_reduce(values)
        return values

    def broadcast_object(self, value):
        """Rank 0's value on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def collective_device() -> torch.device:
    """Where tensors for collectives live: the local GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_s: float) -> DistContext:
    """Join the process group when started by torchrun; otherwise a world of one."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        store = attempt_store(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        # From here a rank's crash can be the echo of another's failure (a collective whose
        # peer has exited): under swiftlm's launcher, only the first failure is shown.
        install_crash_hook()
    return DistContext(rank=rank, world_size=world, local_rank=local_rank)


def attempt_store(timeout: timedelta):
    """The env:// rendezvous store, with its own key space for each torchrun restart.

    torchrun's agent keeps one store across restarts of the worker group (`--max_restarts`),
    and torch does not separate attempts: restarted workers read the dead workers' gloo
    addresses / NCCL ids and fail to connect. On several nodes this relies on every agent
    having restarted as often, as they do when the whole group fails and restarts together.
    An elastic job's workers get a fresh store each time instead (hosted by worker rank 0,
    see `launch.worker_environment`): nothing of an earlier set of workers is in it, and the
    agents' restart counts differ once a node has joined, so no prefix.
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        return store
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"default_pg/attempt-{attempt}", store)


# Environment variables set by init_single_process_group -> their earlier values (None: unset),
# put back at shutdown.
_env_before_single_group: dict[str, str | None] = {}


def init_single_process_group(device: torch.device) -> None:
    """A process group of one rank, for engines that need one even in a single process.

    DeepSpeed, given no process group and no torchrun variables, falls back to MPI discovery
    (and fails without mpi4py). An in-memory store needs no port and no rendezvous. DeepSpeed
    also reads LOCAL_RANK (the device index) from the environment, so it is set here and
    removed again at shutdown: a later run in the same process (tests, notebooks) must not
    look like a torchrun worker.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    local_rank = str(device.index or 0)
    _env_before_single_group.setdefault("LOCAL_RANK", os.environ.get("LOCAL_RANK"))
    os.environ["LOCAL_RANK"] = local_rank
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in _env_before_single_group.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _env_before_single_group.clear()
