"""Paged-cache block manager with prefix caching.

A *full* block is identified by a hash chain over its tokens: ``h_i = hash((h_{i-1}, tokens of block i))``,
so two sequences share block i only if they agree on every token up to the end of that block. Shared
blocks are reference-counted; a block whose count drops to 0 stays cached (its hash still resolves)
until free space runs out, then the least recently used one is evicted. The token lists are stored
with the hash and compared on a hit, so a hash collision can never hand out the wrong block.
Host-side only: it runs before a step, in plain Python.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class _Block:
    id: int
    ref: int = 0
    key: tuple | None = None  # (hash, tokens) once the block is full and registered


@dataclass
class Allocation:
    """A sequence's blocks and how many of its leading tokens are already in the cache."""

    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0


class BlockManager:
    """Allocates cache blocks to sequences, sharing full blocks of common prefixes."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # never-cached free blocks
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 cached blocks, LRU first

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free or evictable)."""
        return len(self.free_ids) + len(self.evictable)

    def _chain(self, tokens: Sequence[int], n_full: int) -> list[tuple[int, tuple]]:
        keys, prev = [], 0
        for i in range(n_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            prev = hash((prev, chunk))
            keys.append((prev, chunk))
        return keys

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.pop()
        if self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            block = self.blocks[bid]
            del self.cached[block.key[0]]
            block.key = None
            return bid
        raise RuntimeError("paged cache is full: no free or evictable block")

    def allocate(self, tokens: Sequence[int], capacity: int | None = None) -> Allocation:
        """Blocks for a new sequence whose prompt is ``tokens``, reusing cached full blocks of its prefix.

        At most the full blocks of ``tokens[:-1]`` are reused, so at least the last token is computed
        (its logits are needed). ``capacity`` (default ``len(tokens)``) is the token count to reserve.
        Raises without changing anything when the blocks do not fit.
        """
        capacity = len(tokens) if capacity is None else capacity
        if capacity < len(tokens) or not tokens:
            raise ValueError(f"need a non-empty prompt and capacity >= len(tokens), got {len(tokens)} and {capacity}")
        hits: list[int] = []
        if self.prefix_caching:
            for key in self._chain(tokens, (len(tokens) - 1) // self.block_size):
                bid = self.cached.get(key[0])
                if bid is None or self.blocks[bid].key != key:
                    break
                hits.append(bid)
        total = -(-capacity // self.block_size)
        fresh = total - len(hits)
        reusable_evictable = sum(1 for b in hits if b in self.evictable)
        if fresh > self.num_free - reusable_evictable:
            raise RuntimeError(f"paged cache is full: need {fresh} new blocks, {self.num_free - reusable_evictable} available")
        for bid in hits:
            self.evictable.pop(bid, None)
            self.blocks[bid].ref += 1
        new = [self._take() for _ in range(fresh)]
        for bid in new:
            self.blocks[bid].ref = 1
        return Allocation(hits + new, len(hits) * self.block_size)

    def grow(self, alloc: Allocation, capacity: int) -> None:
        """Make ``alloc`` hold ``capacity`` tokens (decode appends)."""
        while len(alloc.blocks) * self.block_size < capacity:
            bid = self._take()
            self.blocks[bid].ref = 1
            alloc.blocks.append(bid)

    def register(self, alloc: Allocation, tokens: Sequence[int]) -> None:
        """After ``tokens`` are in the cache, make the sequence's full blocks findable by later prompts.

        Call it only once the step that wrote them succeeded: a registered block is trusted to hold
        its tokens' keys, so a block of a failed step must stay unregistered (it is then freed).
        """
        if not self.prefix_caching:
            return
        for i, key in enumerate(self._chain(tokens, len(tokens) // self.block_size)):
            block = self.blocks[alloc.blocks[i]]
            if block.key is None and key[0] not in self.cached:
                block.key = key
                self.cached[key[0]] = block.id

    def free(self, alloc: Allocation) -> None:
        """Release a finished sequence: cached blocks become evictable (LRU), the rest free."""
        for bid in reversed(alloc.blocks):  # tail blocks first, so prefix blocks stay cached longest
            block = self.blocks[bid]
            block.ref -= 1
            if block.ref > 0:
                continue
            if block.key is not None:
                self.evictable[bid] = None
            else:
                self.free_ids.append(bid)
        alloc.blocks = []
