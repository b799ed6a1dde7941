"""Ring attention over a sequence-parallel group (`--sequence_parallel_impl ring`).

Ulysses (sequence_parallel.py) gives each rank 1/N of the heads, so the heads must divide by N.
The ring needs no such thing: each rank keeps its shard's queries, and the key/value shards of
the group travel round the ring, one hop per step (point-to-point, gloo or NCCL). Rank r meets
shard r - s at step s and folds that block's attention into its output with the online
softmax: per query row, the running output is rescaled by exp(lse_old - lse_new) and the
block's by exp(lse_block - lse_new), lse being each part's log-sum-exp of scores. After N steps
every query has seen every key, and the result equals attention over the whole sequence.

Which keys a query may see is computed from global indices, not assumed per shard: causal
(key index <= query index), the same packed sample (samples read from the gathered position
ids: a sample starts wherever a position does not follow its predecessor), and a sliding
window where the model has one. Shards after r hold only future keys and are skipped, so with
contiguous shards rank r does r + 1 blocks of work (rank N - 1 the most).

Backward is the same ring again, FlashAttention's way: each block's score gradient is
recomputed from the saved *global* output and log-sum-exp (P = exp(S - lse), dS = P * (dP - D)
with D = rowsum(dO * O)), so no block's probabilities are kept between forward and backward.
The key/value gradients of a block travel with it and arrive home after the N-th hop.

Per step and rank only one block's scores exist, and queries are taken in chunks small enough
that a chunk's scores hold at most `SCORE_ELEMENTS` floats (16 MiB): a long shard's transient
memory stays that of a few chunks, not heads x L x L. The products run in float32 whatever
the model's dtype (softmax statistics need it).
"""

import torch
import torch.distributed as dist

from swiftlm.errors import ConfigError
from swiftlm.models.sequence_group import SEQUENCE_GROUP

RING = "swiftlm_ring"
SCORE_ELEMENTS = 1 << 22


def sample_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] global position ids -> [B, T] sample index per token: a new sample starts where
    a position is not its predecessor's + 1 (packed rows restart at 0; padding continues)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cumsum(starts.long(), dim=1)


def _visible(query_index, key_index, query_sample, key_sample, window) -> torch.Tensor:
    """[B, 1, Q, K] which keys each query attends: causal, same sample, inside the window."""
    qi, kj = query_index[:, None], key_index[None, :]
    allowed = (kj <= qi) & (query_sample[:, None, :, None] == key_sample[:, None, None, :])
    if window:
        allowed = allowed & (qi - kj < window)
    return allowed


def _repeat_heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads [B, Hkv, K, D] -> query heads [B, Hkv * groups, K, D] (GQA)."""
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _fold_heads(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: sum each key/value head's query-head group."""
    if groups == 1:
        return tensor
    b, h, k, d = tensor.shape
    return tensor.view(b, h // groups, groups, k, d).sum(dim=2)


class _Ring:
    """The group's ring: this rank's place and the hop of a list of tensors to the next rank."""

    def __init__(self, group):
        self.group = group
        self.size = group.size()
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_hop(self, tensors: list[torch.Tensor]):
        """Send `tensors` on and receive the previous rank's; returns (received, requests)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.previous, self.group) for t in received]
        return received, dist.batch_isend_irecv(ops)

    def source(self, step: int) -> int:
        """The shard this rank holds at `step` of the ring."""
        return (self.rank - step) % self.size


def _finish(requests) -> None:
    for request in requests:
        request.wait()


class _Layout:
    """The global token indices and samples of this rank's queries and of any key shard."""

    def __init__(self, samples: torch.Tensor, rank: int, length: int, window):
        self.samples, self.length, self.window = samples, length, window
        self.query_start = rank * length

    def visible(self, chunk: slice, source: int) -> torch.Tensor:
        device = self.samples.device
        start = self.query_start + chunk.start
        query_index = torch.arange(start, self.query_start + chunk.stop, device=device)
        key_index = torch.arange(source * self.length, (source + 1) * self.length, device=device)
        return _visible(
            query_index,
            key_index,
            self.samples[:, start : self.query_start + chunk.stop],
            self.samples[:, key_index[0] : key_index[-1] + 1],
            self.window,
        )


def _chunks(q: torch.Tensor, keys: int) -> list[slice]:
    """Query row ranges whose [B, H, rows, keys] scores fit SCORE_ELEMENTS."""
    batch, heads, length, _ = q.shape
    rows = max(1, SCORE_ELEMENTS // (batch * heads * keys))
    return [slice(s, min(s + rows, length)) for s in range(0, length, rows)]


def _block_scores(q, k, visible, scale) -> torch.Tensor:
    return (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))


def _fold_block(out, lse, block_out, block_lse) -> None:
    """Online softmax: merge a block's (output, lse) into the running ones, in place. Rows
    that have seen no key yet keep lse -inf, and their weights are 0, not NaN."""
    merged = torch.logaddexp(lse, block_lse)
    old = torch.exp(lse - merged).nan_to_num(0.0)
    new = torch.exp(block_lse - merged).nan_to_num(0.0)
    out.mul_(old[..., None]).add_(block_out * new[..., None])
    lse.copy_(merged)


def _forward_block(q, k, v, layout, source, scale, out, lse) -> None:
    for chunk in _chunks(q, k.shape[2]):
        scores = _block_scores(q[:, :, chunk], k, layout.visible(chunk, source), scale)
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - block_lse[..., None]).nan_to_num(0.0)
        _fold_block(out[:, :, chunk], lse[:, :, chunk], probs @ v, block_lse)


def _backward_block(q, k, v, grad_out, delta, lse, layout, source, scale, grads) -> None:
    """Add one key shard's share to dq, and to the shard's dk, dv (`grads`: dq, dk, dv)."""
    grad_q, grad_k, grad_v = grads
    for chunk in _chunks(q, k.shape[2]):
        scores = _block_scores(q[:, :, chunk], k, layout.visible(chunk, source), scale)
        probs = torch.exp(scores - lse[:, :, chunk, None]).nan_to_num(0.0)
        grad_v += probs.transpose(-1, -2) @ grad_out[:, :, chunk]
        grad_scores = probs * (grad_out[:, :, chunk] @ v.transpose(-1, -2) - delta[:, :, chunk])
        grad_q[:, :, chunk] += grad_scores @ k * scale
        grad_k += grad_scores.transpose(-1, -2) @ q[:, :, chunk] * scale


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries [B, H, L, D] over the whole group's keys and
    values [B, Hkv, L, D] (each rank passes its own shard), for `samples` [B, N * L]."""

    @staticmethod
    def forward(ctx, query, key, value, samples, group, scale, window):
        ring = _Ring(group)
        groups = query.shape[1] // key.shape[1]
        layout = _Layout(samples, ring.rank, query.shape[2], window)
        q = query.float()
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        shard = [key.float().contiguous(), value.float().contiguous()]  # sent as they are
        for step in range(ring.size):
            hop = ring.start_hop(shard) if step < ring.size - 1 else None
            if ring.source(step) <= ring.rank:  # later shards are all in the future
                k, v = (_repeat_heads(t, groups) for t in shard)
                _forward_block(q, k, v, layout, ring.source(step), scale, out, lse)
            if hop is not None:
                shard, requests = hop
                _finish(requests)
        ctx.save_for_backward(query, key, value, samples, out, lse)
        ctx.group, ctx.scale, ctx.window = group, scale, window
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, samples, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        groups = query.shape[1] // key.shape[1]
        layout = _Layout(samples, ring.rank, query.shape[2], ctx.window)
        q, grad_out = query.float(), grad_output.float()
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        shard = [key.float().contiguous(), value.float().contiguous()]  # sent as they are
        shard_grads = [torch.zeros_like(shard[0]), torch.zeros_like(shard[1])]
        for step in range(ring.size):
            if ring.source(step) <= ring.rank:
                k, v = (_repeat_heads(t, groups) for t in shard)
                grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
                grads = (grad_q, grad_k, grad_v)
                _backward_block(
                    q, k, v, grad_out, delta, lse, layout, ring.source(step), ctx.scale, grads
                )
                shard_grads[0] += _fold_heads(grad_k, groups)
                shard_grads[1] += _fold_heads(grad_v, groups)
            # The shard's gradients ride with it; the N-th hop brings each rank its own.
            last = step == ring.size - 1
            (received, requests) = ring.start_hop(shard_grads if last else shard + shard_grads)
            _finish(requests)
            shard, shard_grads = (None, received) if last else (received[:2], received[2:])
        grad_key, grad_value = (g.to(key.dtype) for g in shard_grads)
        return grad_q.to(query.dtype), grad_key, grad_value, None, None, None, None


UNSUPPORTED = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks"}


def _check_options(module, kwargs) -> None:
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"--sequence_parallel_impl ring: this model uses {what} (`{name}`), which the "
                "ring does not compute; use --sequence_parallel_impl ulysses"
            )
    if module.training and kwargs.get("dropout"):
        raise ConfigError(
            f"--sequence_parallel_impl ring: the model's attention dropout is "
            f"{kwargs['dropout']}, and the ring computes attention without dropout; set the "
            "model config's attention_dropout to 0 or use --sequence_parallel_impl ulysses"
        )


def ring_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention interface over a sequence shard (q, k, v [B, heads, L + 1, D],
    after RoPE; the last token is the look-ahead, see sequence_parallel.py): ring attention
    over the group. Returns ([B, L + 1, heads, D], None) with the look-ahead's output zero."""
    from swiftlm.distributed.sequence_parallel import gathered_positions

    _check_options(module, kwargs)
    group = getattr(module, SEQUENCE_GROUP)
    positions = gathered_positions(kwargs["position_ids"][:, :-1], group, group.size())
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    output = RingAttention.apply(
        query[:, :, :-1],
        key[:, :, :-1],
        value[:, :, :-1],
        sample_ids(positions),
        group,
        scale,
        window,
    )
    return torch.nn.functional.pad(output.transpose(1, 2), (0, 0, 0, 0, 0, 1)), None
