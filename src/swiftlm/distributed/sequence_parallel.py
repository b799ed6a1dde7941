"""Sequence parallel, DeepSpeed-Ulysses style (`--sequence_parallel_size N`).

The N ranks of a sequence-parallel group read the same micro-batch and each keeps one shard of
its tokens (`shard_sequence`), so activations, logits and the loss of a long sequence are
split N ways. Everything but attention works token by token; attention needs the whole
sequence, so around it (`ulysses_attention`) an all-to-all swaps the shards: each rank gives
away all but 1/N of the heads of its shard and receives its 1/N of the heads for the whole
sequence, attends, and swaps back. Heads and key/value heads must divide by N; where they do
not, the ring (ring_attention.py) passes key/value shards round the group instead
(`--sequence_parallel_impl`, `resolve_impl`).

The shards and the shift of causal LM losses. A loss pairs the logits at t with the label at
t + 1, so the last position of a shard needs the first label of the next shard. Each shard
therefore holds L + 1 tokens (L = ceil(T / N)): its own L and one *look-ahead*, the next
shard's first token, which only lends its label. The look-ahead is left out of attention (its
keys and values would count twice in the gathered sequence) and its output is zero; the logit
it produces is the one a loss drops after the shift. Its masks are 0, so token counts see each
token once, and every label is a target on exactly one rank: the losses of the N shards sum
to the loss of the whole sequence, with positions (RoPE) and packed samples' boundaries read
from the global position ids.
"""

import torch
import torch.nn.functional as F

from swiftlm.errors import ConfigError
from swiftlm.models.sequence_group import SEQUENCE_GROUP

ULYSSES = "swiftlm_ulysses"
SEQUENCE_MASKS = ("attention_mask", "token_mask")


def _padded(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]), value=value)


def _row_set(batch: dict, prefix: str, pads: dict) -> dict[str, object]:
    """The token-aligned tensors of one row set (`prefix` + a padded name), with its width."""
    width = batch[prefix + "input_ids"].shape[1]
    names = [prefix + name for name in (*pads, *SEQUENCE_MASKS, "position_ids")]
    return {name: width for name in names if name in batch}


def _shard_rows(batch: dict, prefix: str, rank: int, size: int, pads: dict) -> dict:
    """Rank `rank`'s shard of one row set's tensors (see `shard_sequence`)."""
    rows, width = batch[prefix + "input_ids"].shape
    length = -(-width // size)
    total = length * size + 1
    tensors = {name: batch[name] for name in _row_set(batch, prefix, pads)}
    if prefix + "position_ids" not in tensors:
        tensors[prefix + "position_ids"] = torch.arange(width).expand(rows, width)
    shard = {}
    for name, tensor in tensors.items():
        key = name.removeprefix(prefix)
        if key == "position_ids":  # the padding continues each row's positions
            extra = tensor[:, -1:] + torch.arange(1, total - width + 1)
            full = torch.cat([tensor, extra], dim=1)
        else:
            full = _padded(tensor, total, pads.get(key, 0))
        shard[name] = full[:, rank * length : rank * length + length + 1].clone()
        if key in SEQUENCE_MASKS:
            shard[name][:, -1] = 0  # the look-ahead is the next shard's token
    return shard


def shard_sequence(batch: dict, rank: int, size: int, pads: dict, row_sets=("",), owned=()) -> dict:
    """Rank `rank`'s shard of a collated causal-LM batch of rows [B, T]: tokens
    [rank * L, rank * L + L] (with the look-ahead), the rows padded with `pads` (input ids,
    labels, masks) to N * L + 1. Position ids come along (made 0..T-1 when absent).

    `row_sets`: the prefixes of the batch's sets of rows, each cut by its own width (KTO's
    matched rows and its mismatched `kl_` rows). `owned`: per-sample weights that only the
    group's first shard keeps (0 on the others), for losses of whole sequences: each rank
    computes the loss from the log-prob sums gathered over the group (models/sequence_group.py),
    and the sample counts once."""
    shard = dict(batch)
    claimed = set()
    for prefix in row_sets:
        claimed |= set(_row_set(batch, prefix, pads))
        shard.update(_shard_rows(batch, prefix, rank, size, pads))
    widths = {batch[prefix + "input_ids"].shape[1] for prefix in row_sets}
    for name, tensor in batch.items():
        token_aligned = isinstance(tensor, torch.Tensor) and tensor.dim() == 2
        if name not in claimed and token_aligned and tensor.shape[1] in widths:
            raise ConfigError(
                f"--sequence_parallel_size {size}: the batch's `{name}` column has no known "
                "padding, so it cannot be cut into sequence shards"
            )
    for name in owned:
        if rank:
            shard[name] = torch.zeros_like(batch[name])
    return shard


def _sequence_to_heads(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """[B, H, L, D] of this rank's shard -> [B, H/N, N*L, D]: its head group, all shards."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    b, h, length, d = tensor.shape
    out = tensor.reshape(b, size, h // size, length, d).transpose(0, 1).contiguous()
    out = wait_tensor(all_to_all_single_autograd(out, None, None, group))
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * length, d)


def _heads_to_sequence(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """[B, H/N, N*L, D] -> [B, H, L, D]: every head, this rank's shard."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    b, h, total, d = tensor.shape
    length = total // size
    out = tensor.reshape(b, h, size, length, d).permute(2, 0, 1, 3, 4).contiguous()
    out = wait_tensor(all_to_all_single_autograd(out, None, None, group))
    return out.transpose(0, 1).reshape(b, size * h, length, d)


def gathered_positions(position_ids: torch.Tensor, group, size: int) -> torch.Tensor:
    """Every shard's position ids [B, L] of the group, in rank order: [B, N*L]."""
    import torch.distributed as dist

    parts = [torch.empty_like(position_ids) for _ in range(size)]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention interface over a sequence shard (q, k, v [B, heads, L + 1, D],
    after RoPE): all-to-all to head shards of the whole sequence, causal SDPA there (per
    sample for packed rows, `models.attention.varlen_sdpa_attention`), all-to-all back.
    Returns ([B, L + 1, heads, D], None); the look-ahead's output is zero."""
    from swiftlm.models.attention import varlen_sdpa_attention

    group = getattr(module, SEQUENCE_GROUP)
    size = group.size()
    position_ids = kwargs.pop("position_ids")
    window = kwargs.get("sliding_window")
    if window and (query.shape[2] - 1) * size > window:
        raise ConfigError(
            f"--sequence_parallel_impl ulysses: this model attends within a sliding window of "
            f"{window} tokens, and Ulysses' attention over the gathered sequence does not apply "
            "it; use --sequence_parallel_impl ring (or auto), which does"
        )
    q, k, v = (_sequence_to_heads(t[:, :, :-1], group, size) for t in (query, key, value))
    positions = gathered_positions(position_ids[:, :-1], group, size)
    output, _ = varlen_sdpa_attention(module, q, k, v, None, position_ids=positions, **kwargs)
    output = _heads_to_sequence(output.transpose(1, 2), group, size).transpose(1, 2)
    return F.pad(output, (0, 0, 0, 0, 0, 1)), None


def resolve_impl(impl: str, config, size: int, tp: int = 1) -> str:
    """--sequence_parallel_impl: `auto` is Ulysses where the heads and key/value heads divide
    by N (fewer, larger messages) and the model has no sliding window (which only the ring
    applies), else the ring. Under tensor parallel a rank holds 1/tp of the heads, and those
    are what Ulysses splits further."""
    text = config.get_text_config()
    heads = text.num_attention_heads // tp
    kv_heads = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // tp
    divides = heads % size == 0 and kv_heads % size == 0
    windowed = bool(getattr(text, "sliding_window", None)) and getattr(
        text, "use_sliding_window", True
    )
    if impl == "auto":
        return "ulysses" if divides and not windowed else "ring"
    if impl == "ulysses" and not divides:
        per_rank = f" per tensor-parallel rank ({tp})" if tp > 1 else ""
        raise ConfigError(
            f"--sequence_parallel_size {size}: the model has {heads} attention heads and "
            f"{kv_heads} key/value heads{per_rank}, and Ulysses gives each rank 1/{size} of "
            "both; choose a size that divides both, or --sequence_parallel_impl ring (any size)"
        )
    return impl


def register_sequence_parallel_attention() -> None:
    """Make `swiftlm_ulysses` and `swiftlm_ring` valid attn_implementations (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from swiftlm.distributed.ring_attention import RING, ring_attention

    for name, attention in ((ULYSSES, ulysses_attention), (RING, ring_attention)):
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, sdpa_mask)  # built for the shard, not read


def apply_sequence_parallel(
    model: torch.nn.Module, sp_mesh, impl: str = "auto", tp: int = 1
) -> str:
    """Run `model`'s attention over the group of `sp_mesh` as Ulysses or as a ring
    (`resolve_impl`; `tp`: the tensor-parallel split of the heads); returns the one chosen."""
    from swiftlm.distributed.parallelize import decoder_layers
    from swiftlm.distributed.ring_attention import RING

    impl = resolve_impl(impl, model.config, sp_mesh.size(), tp)
    register_sequence_parallel_attention()
    for layer in decoder_layers(model):
        setattr(layer.self_attn, SEQUENCE_GROUP, sp_mesh.get_group())
    model.config._attn_implementation = ULYSSES if impl == "ulysses" else RING
    if torch.distributed.get_rank() == 0:
        print(f"sequence parallel {sp_mesh.size()}: {impl} attention", flush=True)
    return impl
