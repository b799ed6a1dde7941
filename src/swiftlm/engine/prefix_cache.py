"""Prefix caching: the keys and values of prompt prefixes, kept across requests, so that a
prompt whose start was prefilled before (a chat that resends its history, evaluation prompts
with a shared few-shot header, requests with one long system prompt) prefills only the rest.

The cache holds blocks of `block_size` tokens. A block is found by a digest of every token up
to its end and the adapter that computed it (sha256 of the previous block's digest, the
block's tokens and the adapter's name), so a hit is always the same tokens, from the start,
through the same weights. Only whole blocks are stored; a lookup returns the longest run of
cached blocks from the prompt's start. Blocks are evicted least recently used first once
their bytes exceed the budget.

The keys and values are those of the model the engine was built with: an engine whose
weights change (rollouts on the live policy, evaluation during training) must not keep a
prefix cache, or must `clear` it after each change.
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16  # tokens per block: small enough that most of a shared prefix is reused


@dataclass
class Block:
    """One block's keys and values, per layer [heads, block_size, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """Blocks of prompt keys/values by prefix digest, within `budget_bytes` (LRU eviction)."""

    def __init__(self, budget_bytes: int, block_size: int = BLOCK_SIZE):
        if budget_bytes <= 0 or block_size <= 0:
            raise ValueError("a prefix cache needs a positive budget and block size")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.used_bytes = 0
        self.hit_tokens = 0  # prompt tokens whose keys/values came from the cache
        self.evicted_blocks = 0

    def digests(self, tokens: list[int], adapter: str | None) -> list[bytes]:
        """The digest of each whole block of `tokens`, in order: what `lookup` and `store`
        take (a prompt's are computed once)."""
        out, previous = [], (adapter or "").encode()
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block = array("q", tokens[start : start + size]).tobytes()
            previous = hashlib.sha256(previous + block).digest()
            out.append(previous)
        return out

    def lookup(self, digests: list[bytes]) -> list[Block]:
        """The cached blocks of the longest run of `digests` from the start, most recently
        used from now on."""
        found = []
        for digest in digests:
            block = self.blocks.get(digest)
            if block is None:
                break
            self.blocks.move_to_end(digest)
            found.append(block)
        return found

    def store(self, digests: list[bytes], keys, values) -> None:
        """Keep the blocks of `digests` the cache lacks; `keys[layer]` and `values[layer]` hold
        their tokens' [heads, tokens, head_dim] from the first block on (copied here)."""
        size = self.block_size
        for index, digest in enumerate(digests):
            if digest in self.blocks:
                continue
            span = slice(index * size, (index + 1) * size)
            block = Block([k[:, span].clone() for k in keys], [v[:, span].clone() for v in values])
            self.blocks[digest] = block
            self.used_bytes += block.nbytes
        self._evict()

    def clear(self) -> None:
        """Drop every block and start the counts again (after the weights changed)."""
        self.blocks.clear()
        self.used_bytes = self.hit_tokens = self.evicted_blocks = 0

    def _evict(self) -> None:
        while self.used_bytes > self.budget_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.used_bytes -= block.nbytes
            self.evicted_blocks += 1


def prefix_tensors(blocks: list[Block], length: int) -> tuple[list, list]:
    """Per layer, the keys and values of the first `length` tokens of `blocks` joined:
    [heads, length, head_dim] each."""
    layers = range(len(blocks[0].keys))
    keys = [torch.cat([b.keys[i] for b in blocks], dim=1)[:, :length] for i in layers]
    values = [torch.cat([b.values[i] for b in blocks], dim=1)[:, :length] for i in layers]
    return keys, values
