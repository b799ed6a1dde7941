"""Gradient compression's state in a checkpoint, so that a compressed run resumes exactly.

Top-k keeps a residual per parameter (what it has not sent yet); PowerSGD keeps, per DDP
bucket, an error-feedback buffer and the warm-started Q factors of the matrices it
compresses, plus an iteration counter and the numpy generator that draws new Q's. Each rank
saves its own (`compression-rank{r}` in the checkpoint's rank_state/, safetensors + JSON),
keyed by parameter name: `CompressionCheckpoint` is that per-rank state object, and the
compressors themselves (`compression`) only carry the state from step to step.

Why per parameter for PowerSGD too: DDP's buckets are a layout, not an identity. A new DDP
(the resumed run) starts with buckets in reverse parameter order and rebuilds them after its
first step in the order gradients became ready, so the resumed run's first step sees other
buckets than the saved run's last step. PowerSGD's math is per tensor (M_i + e_i, P_i = M_i
Q_i, Q_i = M_i^T P_i), so moving each tensor's error and Q to wherever its parameter is now
gives the very same numbers; `PowerSGDLayouts` does that move whenever a bucket index shows
up with other parameters than it last had.
"""

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

# ---- PowerSGD: bucket buffers <-> per-parameter tensors ------------------------------------


def compressed_order(params: list, ps: powersgd.PowerSGDState) -> list[tuple[int, int, int]]:
    """(index in `params`, length of its Q, of its P) of each tensor PowerSGD compresses, in
    the order of the Q buffer: grouped by matrix shape (first shape first), as torch's hook
    lays it out."""
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, p in enumerate(params):
        n = p.shape[0]
        m = p.numel() // n
        rank = min(n, m, ps.matrix_approximation_rank)
        if powersgd._should_compress(n, m, rank, ps.min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append((i, m * rank, n * rank))
    return [entry for group in by_shape.values() for entry in group]


class PowerSGDLayouts:
    """Keeps PowerSGD's per-bucket buffers matched to the parameters in each bucket."""

    def __init__(self, ps: powersgd.PowerSGDState, params: dict[int, torch.nn.Parameter]):
        self.ps, self.params = ps, params  # params: id -> parameter
        self.layouts: dict[int, list[int]] = {}  # bucket index -> its parameters' ids
        self.loose: dict[int, dict[str, torch.Tensor]] = {}  # id -> {"error", "q"}

    def align(self, bucket) -> None:
        """Before torch's hook sees `bucket`: give it the state of the parameters in it."""
        index, ids = bucket.index(), [id(p) for p in bucket.parameters()]
        if self.layouts.get(index) == ids:
            return
        if index in self.layouts:  # DDP rebuilt its buckets: every bucket's state moves
            self.unpack_all()
        self._pack(index, ids, bucket.buffer())
        self.layouts[index] = ids

    def unpack_all(self) -> None:
        """Every bucket's buffers -> per-parameter tensors (`loose`)."""
        ps = self.ps
        for index, ids in self.layouts.items():
            params = [self.params[i] for i in ids]
            error = ps.error_dict.pop(index, None)
            if error is not None:
                parts = error.split([p.numel() for p in params])
                for i, part in zip(ids, parts, strict=True):
                    self.loose.setdefault(i, {})["error"] = part.clone()
            q = ps.q_memory_dict.pop(index, None)
            ps.p_memory_dict.pop(index, None)  # P = M Q each step: nothing carried over
            if q is not None:
                order = compressed_order(params, ps)
                parts = q.split([q_length for _, q_length, _ in order])
                for (position, _, _), part in zip(order, parts, strict=True):
                    self.loose.setdefault(ids[position], {})["q"] = part.clone()
        self.layouts.clear()

    def _pack(self, index: int, ids: list[int], buffer: torch.Tensor) -> None:
        """Per-parameter tensors of the bucket's parameters -> its buffers; parameters with
        none get zero error and, when any Q is missing, torch draws the bucket's Q's anew."""
        ps = self.ps
        found = [self.loose.pop(i, {}) for i in ids]
        if not any(found):
            return
        params = [self.params[i] for i in ids]
        device, dtype = buffer.device, buffer.dtype
        if any("error" in f for f in found):
            ps.error_dict[index] = torch.cat(
                [
                    f["error"].to(device, dtype) if "error" in f else buffer.new_zeros(p.numel())
                    for f, p in zip(found, params, strict=True)
                ]
            )
        order = compressed_order(params, ps)
        if order and all("q" in found[position] for position, _, _ in order):
            qs = [found[position]["q"].to(device, dtype) for position, _, _ in order]
            ps.q_memory_dict[index] = torch.cat(qs)
            p_size = sum(p_length for _, _, p_length in order)
            ps.p_memory_dict[index] = torch.empty(p_size, device=device, dtype=dtype)

    def state_dict(self, names: dict[int, str]) -> dict:
        self.unpack_all()  # the next hook call packs them again: a pure move
        ps = self.ps
        kind, keys, position, has_gauss, gauss = ps.rng.get_state()
        return {
            "iter": ps.iter,
            "rng": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(gauss),
            },
            "numel_before": ps.total_numel_before_compression,
            "numel_after": ps.total_numel_after_compression,
            "params": {names[i]: dict(state) for i, state in self.loose.items()},
        }

    def load_state_dict(self, state: dict, ids: dict[str, int]) -> None:
        ps, rng = self.ps, state["rng"]
        ps.iter = state["iter"]
        keys = rng["keys"].numpy().astype(np.uint32)
        ps.rng.set_state((rng["kind"], keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        ps.total_numel_before_compression = state["numel_before"]
        ps.total_numel_after_compression = state["numel_after"]
        ps.error_dict.clear(), ps.p_memory_dict.clear(), ps.q_memory_dict.clear()
        self.layouts.clear()
        self.loose = {ids[name]: dict(s) for name, s in state["params"].items() if name in ids}


# ---- the per-rank checkpoint state ---------------------------------------------------------

# The methods that carry something from step to step; none, fp16 and bf16 carry nothing.
STATEFUL = ("topk", "powersgd")


class CompressionCheckpoint:
    """What --grad_compression carries from step to step, as each rank's checkpoint state
    (`checkpoint.save` writes it as rank_state/compression-rank{r}): top-k's residuals,
    PowerSGD's errors, Q factors, counter and generator.

    `hook_state` is the state `compression.register_compression` built for `method` (a
    `TopKState` for topk, a `PowerSGDCountingState` for powersgd): the method says which, so
    this module needs nothing from the hooks' module, which builds it.
    """

    state_name = "compression"

    def __init__(self, method: str, hook_state, params: dict[str, torch.nn.Parameter]):
        self.method, self.hook_state = method, hook_state
        self.params = {id(p): p for p in params.values()}
        self.names = {id(p): name for name, p in params.items()}
        self.ids = {name: id(p) for name, p in params.items()}

    def state_dict(self) -> dict:
        state: dict = {"method": self.method}
        if self.method == "topk":
            residuals = self.hook_state.residuals.items()
            state["residuals"] = {self.names[i]: r for i, r in residuals}
        elif self.method == "powersgd":
            state["powersgd"] = self.hook_state.layouts.state_dict(self.names)
        return state

    def load_state_dict(self, saved: dict | None) -> str | None:
        """Restore the saved state; a note for the log when it cannot be (None: restored, or
        nothing to restore). A stateless method (none, fp16, bf16) carries nothing."""
        was = saved["method"] if saved else None
        if was != self.method:
            return _other_method_note(was, self.method)
        if self.method == "topk":
            self.hook_state.residuals = self._residuals_here(saved["residuals"])
        elif self.method == "powersgd":
            self.hook_state.layouts.load_state_dict(saved["powersgd"], self.ids)
        return None

    def _residuals_here(self, saved: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Saved residuals by name -> by this run's parameter objects, on their devices;
        names this model lacks are dropped."""
        return {
            self.ids[name]: r.to(self.params[self.ids[name]].device)
            for name, r in saved.items()
            if name in self.ids
        }


def _other_method_note(was: str | None, now: str) -> str | None:
    """What happens to the saved state when the resumed run compresses otherwise (`was` is
    None when this rank saved none); None when neither method carries state."""
    if was in STATEFUL:
        return (
            f"the checkpoint's --grad_compression {was} state (the gradient not sent "
            f"yet) is dropped: this run uses --grad_compression {now}"
        )
    if now in STATEFUL:
        why = f"saved with --grad_compression {was}" if was else "none for this rank"
        return f"--grad_compression {now} starts with an empty state ({why})"
    return None
