"""Weights pushed from a trainer into a running vLLM engine over a collective: the weight sync
of `swiftlm rollout` (server mode), as `trl vllm-serve` does it.

The trainer and vLLM's workers form a process group of their own, apart from any
torch.distributed group the trainer runs in: a TCPStore that worker 0 hosts on the group
port, the workers as ranks 0 .. W-1 and the trainer as rank W. It is gloo, or NCCL when
both sides are on CUDA devices. A push sends the weights in byte buckets of at most
`BUCKET_BYTES`: the names, shapes and dtypes go to the server over HTTP (`bucket_specs`),
the bytes as one flat uint8 tensor per bucket broadcast from the trainer, and each worker
loads them with vLLM's in-place `reload_weights` (its own name mapping: q/k/v into qkv ...).

`WeightSyncExtension` is mixed into vLLM's worker class (`worker_extension_cls`); the server
calls its methods by name with `collective_rpc`, so nothing is pickled.

Both sides drop their group explicitly when done (`close`): a gloo group still alive when
its process exits may abort it ("terminate called without an active exception", seen about
one exit in eight here), and the worker's store must free the port for the next trainer.
"""

import datetime
import math
from dataclasses import asdict, dataclass

import torch

WORKER_EXTENSION = "swiftlm.engine.vllm_weight_sync.WeightSyncExtension"
BUCKET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch.": "bfloat16" ...

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def process_group(host: str, port: int, rank: int, size: int, backend: str, timeout_s: float):
    """This process's member of the weight-sync group. Rank 0 hosts the store; the others
    connect to it at `host:port` (and wait up to `timeout_s` for it to appear)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, size, rank == 0, timeout=timeout)
    if backend == "nccl":
        return torch.distributed.ProcessGroupNCCL(store, rank, size)
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


def sync_backend(trainer_device: str, worker_device: str) -> str:
    """NCCL when both sides hold their weights on CUDA devices, gloo otherwise."""
    return "nccl" if trainer_device == worker_device == "cuda" else "gloo"


def buckets(state: dict[str, torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[str]]:
    """The tensors' names in order, cut into buckets of at most `limit` bytes (a bigger
    tensor goes alone in its own)."""
    cut, size = [[]], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if cut[-1] and size + nbytes > limit:
            cut.append([])
            size = 0
        cut[-1].append(name)
        size += nbytes
    return [names for names in cut if names]


def bucket_specs(state: dict[str, torch.Tensor], names: list[str]) -> list[dict]:
    """What the receiver needs to cut a bucket's bytes back into tensors (JSON-ready)."""
    return [
        asdict(TensorSpec(name, tuple(state[name].shape), str(state[name].dtype)[6:]))
        for name in names
    ]


def flat_bytes(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes, one after another, as one uint8 tensor on `device`."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts).to(device)


def split_bytes(flat: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """`flat_bytes` undone: (name, tensor) per spec, views into `flat` (a copy where a
    tensor's bytes do not start at a multiple of its element size)."""
    total = sum(spec.nbytes for spec in specs)
    if total != flat.numel():
        raise ValueError(f"weight bucket: {flat.numel()} bytes received, the specs add to {total}")
    out, start = [], 0
    for spec in specs:
        piece = flat[start : start + spec.nbytes]
        if start % spec.torch_dtype.itemsize:
            piece = piece.clone()
        out.append((spec.name, piece.view(spec.torch_dtype).reshape(spec.shape)))
        start += spec.nbytes
    return out


class TrainerSide:
    """The trainer's member of the group: broadcasts its weights to the workers."""

    def __init__(self, host: str, port: int, workers: int, backend: str, timeout_s: float):
        self.rank = workers  # the workers are 0 .. workers - 1
        self.backend = backend
        self.group = process_group(host, port, self.rank, workers + 1, backend, timeout_s)

    def push(self, state: dict[str, torch.Tensor], names: list[str]) -> None:
        """Broadcast one bucket (the order the workers were told by `bucket_specs`)."""
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        flat = flat_bytes([state[name] for name in names], device)
        self.group.broadcast(flat, self.rank).wait()

    def close(self) -> None:
        self.group = None


class WeightSyncExtension:
    """Methods mixed into vLLM's worker (`worker_extension_cls`), called by name through
    `collective_rpc` from the rollout server; `self` is the worker (device, rank,
    reload_weights)."""

    def init_weight_sync(self, host: str, port: int, workers: int, backend: str, timeout_s: float):
        self.close_weight_sync()  # a previous trainer's group frees the port first
        self.swiftlm_backend = backend
        self.swiftlm_trainer_rank = workers
        self.swiftlm_group = process_group(host, port, self.rank, workers + 1, backend, timeout_s)

    def receive_weights(self, buckets: list[list[dict]]) -> int:
        """Receive the buckets the trainer broadcasts and load them in place, in one vLLM
        reload (its layerwise reload wants every weight in one pass): the buckets are
        received as the loader consumes them, so one bucket's copy is held at a time."""
        received = []

        def weights():
            device = self.device if self.swiftlm_backend == "nccl" else torch.device("cpu")
            for raw_specs in buckets:
                specs = [TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in raw_specs]
                flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=device)
                self.swiftlm_group.broadcast(flat, self.swiftlm_trainer_rank).wait()
                received.extend(spec.name for spec in specs)
                yield from split_bytes(flat, specs)

        self.reload_weights(weights_iterator=weights())
        return len(received)

    def close_weight_sync(self) -> None:
        self.swiftlm_group = None
