"""Paged-cache block manager with prefix caching.

A *full* block is identified by a hash chain over its tokens: ``h_i = hash((h_{i-1}, tokens of block i))``,
so two sequences share block i only if they agree on every token up to the end of that block. Shared
blocks are reference-counted; a block whose count drops to 0 stays cached (its hash still resolves)
until free space runs out, then the least recently used one is evicted. The token lists are stored
with the hash and compared on a hit, so a hash collision can never hand out the wrong block.
Host-side only: it runs before a step, in plain Python.

With ``sink_window=(sink, window)`` (a model whose every query reads only the first ``sink`` and the last
``window`` positions of its prefix, ``patch(..., sparse="sink_window")``; or DeepSeek-V4's sliding token rows,
``(0, 128)``) a sequence's memory stays bounded however long it runs: :meth:`BlockManager.release_outside`
gives back the blocks that no later query can read, and the sequence's table keeps its positions, the
released entries pointing at one shared ``null_block`` that is never read, written, registered or handed
out. Admission reserves what the sequence can ever hold at once (:meth:`BlockManager.peak_blocks`) instead
of its whole length, and :meth:`BlockManager.grow` draws new blocks from that reservation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from mla_compile.models.config import check_sink_window
from mla_compile.models.metadata import SeqChunk


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
    capacity: int = 0  # tokens the sequence may reach (its prompt plus new tokens)
    released: int = 0  # entries of ``blocks`` given back by release_outside (they hold the null block)
    reserved: int = 0  # blocks promised to its later growth (windowed managers), not yet taken
    held: int = 0  # entries of ``blocks`` that are not released (windowed managers; set by _rebalance)


class BlockManager:
    """Allocates cache blocks to sequences, sharing full blocks of common prefixes."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 sink_window: tuple[int, int] | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # never-cached free blocks
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 cached blocks, LRU first
        self.sink_window = None if sink_window is None else _check_sink_window(sink_window)
        self.reserved = 0  # blocks promised to windowed allocations' growth (sum of their ``reserved``)
        self.null_block: int | None = None
        if self.sink_window is not None:
            if num_blocks < 2:
                raise ValueError(f"a windowed BlockManager needs num_blocks >= 2 (one is the null block), "
                                 f"got {num_blocks}")
            self.null_block = self.free_ids.pop()  # block 0: the table entry of every released block
            self.blocks[self.null_block].ref = 1  # pinned: never freed, evicted or registered
        # windowed: what live sequences hold (each counts a block it shares with others) plus what they have
        # reserved. Admission keeps it within the usable blocks, so however shared blocks come and go (a release
        # of a shared block frees nothing) the reservations are always backed: num_free >= usable - claimed >= 0
        self.claimed = 0

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free or evictable, less those reserved for windowed growth)."""
        return len(self.free_ids) + len(self.evictable) - self.reserved

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences can hold (all but the null block of a windowed manager)."""
        return len(self.blocks) - (self.null_block is not None)

    def peak_blocks(self, prompt_len: int, capacity: int) -> int:
        """The most blocks a sequence with a ``prompt_len``-token prompt, reaching ``capacity`` tokens, holds at
        once: all of its blocks, or (windowed) its prompt's, or its sink's plus a window's plus one, whichever is
        larger. Exact as long as :meth:`release_outside` runs after every step."""
        total = -(-capacity // self.block_size)
        if self.sink_window is None:
            return total
        sink, window = self.sink_window
        bs = self.block_size
        return min(total, max(-(-prompt_len // bs), -(-sink // bs) + -(-window // bs) + 1))

    def peak_tokens(self, prompt_len: int, capacity: int) -> int:
        """:meth:`peak_blocks` in tokens (what admission compares to the cache)."""
        return self.peak_blocks(prompt_len, capacity) * self.block_size

    def _rebalance(self, alloc: Allocation) -> None:
        """Set ``alloc.reserved`` to what it may still take: up to its peak, at most the blocks it still lacks
        (and keep :attr:`claimed` in step)."""
        if self.sink_window is None:
            return
        before = alloc.held + alloc.reserved
        alloc.held = len(alloc.blocks) - alloc.released
        lacking = -(-alloc.capacity // self.block_size) - len(alloc.blocks)
        want = max(0, min(self.peak_blocks(0, alloc.capacity) - alloc.held, lacking))
        self.reserved += want - alloc.reserved
        alloc.reserved = want
        self.claimed += alloc.held + alloc.reserved - before

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

    def chain_keys(self, tokens: Sequence[int], n_full: int) -> list[int]:
        """The prefix-cache keys (chain hashes) of the first ``n_full`` full blocks of ``tokens``: key ``i`` names
        ``tokens[:(i + 1) * block_size]``."""
        return [h for h, _ in self._chain(tokens, n_full)]

    def _hits(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The cached blocks of ``tokens``' leading full blocks, at most ``limit`` of them."""
        hits: list[int] = []
        if self.prefix_caching:
            for key in self._chain(tokens, limit):
                bid = self.cached.get(key[0])
                if bid is None or self.blocks[bid].key != key:
                    break
                hits.append(bid)
        return hits

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        """How many leading full blocks of ``tokens[:-1]`` the prefix cache holds now (what :meth:`allocate`
        would reuse); takes nothing."""
        return len(self._hits(tokens, (len(tokens) - 1) // self.block_size))

    def allocate(self, tokens: Sequence[int], capacity: int | None = None, *,
                 max_cached: int | None = None) -> Allocation:
        """Blocks for a new sequence whose prompt is ``tokens``, reusing cached full blocks of its prefix.

        At most the full blocks of ``tokens[:-1]`` are reused, so at least the last token is computed
        (its logits are needed), and at most ``max_cached`` tokens' worth (None: no further limit).
        ``capacity`` (default ``len(tokens)``) is the token count to reserve.
        Raises without changing anything when the blocks do not fit.
        """
        capacity = len(tokens) if capacity is None else capacity
        if capacity < len(tokens) or not tokens:
            raise ValueError(f"need a non-empty prompt and capacity >= len(tokens), got {len(tokens)} and {capacity}")
        limit = (len(tokens) - 1) // self.block_size
        if max_cached is not None:
            limit = min(limit, max_cached // self.block_size)
        hits = self._hits(tokens, limit)
        # a windowed manager takes the prompt's blocks now and reserves the rest of the sequence's peak
        now = -(-(capacity if self.sink_window is None else len(tokens)) // self.block_size)
        fresh = now - len(hits)
        later = max(self.peak_blocks(len(tokens), capacity) - now, 0) if self.sink_window is not None else 0
        reusable_evictable = sum(1 for b in hits if b in self.evictable)
        if fresh + later > self.num_free - reusable_evictable:
            raise RuntimeError(f"paged cache is full: need {fresh + later} new blocks, "
                               f"{self.num_free - reusable_evictable} available")
        if self.sink_window is not None and self.claimed + now + later > self.usable_blocks:
            # a block shared with a live sequence is no memory saved for good: when that sequence's window
            # leaves it, this one still holds it (and the other needs a new block)
            raise RuntimeError(f"paged cache is full: need {now + later} blocks at its peak, "
                               f"{self.usable_blocks - self.claimed} not claimed by running sequences")
        for bid in hits:
            self.evictable.pop(bid, None)
            self.blocks[bid].ref += 1
        new = [self._take() for _ in range(fresh)]
        for bid in new:
            self.blocks[bid].ref = 1
        alloc = Allocation(hits + new, len(hits) * self.block_size, capacity)
        self._rebalance(alloc)
        return alloc

    def grow(self, alloc: Allocation, capacity: int) -> None:
        """Make ``alloc`` hold ``capacity`` tokens (decode appends); a no-op when it already does. A windowed
        allocation takes the blocks from its reservation (raises if ``capacity`` passes the one it was
        allocated for)."""
        if self.sink_window is not None and capacity > max(alloc.capacity, len(alloc.blocks) * self.block_size):
            raise ValueError(f"grow: capacity {capacity} exceeds the allocation's {alloc.capacity} tokens, which "
                             "its reservation was made for")
        while len(alloc.blocks) * self.block_size < capacity:
            if alloc.reserved > 0:
                alloc.reserved -= 1
                self.reserved -= 1
                self.claimed -= 1  # held again by _rebalance below: the take moves a claim, adds none
            elif self.num_free <= 0:
                raise RuntimeError("paged cache is full: no free or evictable block")
            bid = self._take()
            self.blocks[bid].ref = 1
            alloc.blocks.append(bid)
        self._rebalance(alloc)

    def release_outside(self, alloc: Allocation, next_pos: int) -> int:
        """Give back ``alloc``'s blocks that no query at ``next_pos`` or later can read: every position in them is
        past the sink (``>= sink``) and before the window of a query at ``next_pos`` (``< next_pos + 1 -
        window``). Their table entries become :attr:`null_block` (positions keep their places; ``alloc.blocks``
        is then a new list, never changed in place, as the keyed ``MetadataBuilder`` expects); a block whose
        reference count drops to 0 returns to the free list, or, when registered in the prefix cache, to the
        evictable ones (its rows still hold its tokens: later prompts may share it until it is evicted).
        Returns how many blocks were released; a no-op (0) without ``sink_window``. Host-side, between steps."""
        if self.sink_window is None:
            return 0
        sink, window = self.sink_window
        bs = self.block_size
        first = -(-sink // bs)  # the first block wholly past the sink
        end = min((next_pos + 1 - window) // bs, len(alloc.blocks)) if next_pos + 1 >= window else 0
        released, blocks = 0, list(alloc.blocks)
        for i in range(first, end):
            bid = blocks[i]
            if bid == self.null_block:
                continue
            self._unref(bid)
            blocks[i] = self.null_block
            released += 1
        if released:  # a new list: builders that keep host tables by list identity see the change
            alloc.blocks = blocks
        alloc.released += released
        self._rebalance(alloc)
        return released

    def _unref(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref -= 1
        if block.ref > 0:
            return
        if block.key is not None:
            self.evictable[bid] = None
        else:
            self.free_ids.append(bid)

    def register(self, alloc: Allocation, tokens: Sequence[int]) -> list[int]:
        """After ``tokens`` are in the cache, make the sequence's full blocks findable by later prompts; returns
        the ids of the blocks this call made findable.

        Call it only once the step that wrote them succeeded: a registered block is trusted to hold
        its tokens' keys, so a block of a failed step must stay unregistered (it is then freed). A caller that
        registers earlier (``Engine(overlap=True)``: at launch) must :meth:`forget` them if the step fails.
        """
        if not self.prefix_caching:
            return []
        made = []
        for i, key in enumerate(self._chain(tokens, len(tokens) // self.block_size)):
            if alloc.blocks[i] == self.null_block:  # released: the null block never holds tokens
                continue
            block = self.blocks[alloc.blocks[i]]
            if block.key is None and key[0] not in self.cached:
                block.key = key
                self.cached[key[0]] = block.id
                made.append(block.id)
        return made

    def forget(self, block_ids: Sequence[int]) -> None:
        """Make blocks :meth:`register` made findable unfindable again (their step failed): later prompts never
        match them. A block already evicted or re-keyed since is left alone."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.key is not None and self.cached.get(block.key[0]) == bid:
                del self.cached[block.key[0]]
                block.key = None
                if bid in self.evictable:  # nobody holds it: free, not evictable, once unkeyed
                    del self.evictable[bid]
                    self.free_ids.append(bid)

    def prefill_chunk(self, start: int, n: int, prompt_len: int) -> int:
        """How many of the ``n`` prompt tokens from ``start`` that the step's budget allows the next prompt chunk
        takes: all of them (managers that must end chunks at particular positions take fewer)."""
        return n

    def chunk(self, alloc: Allocation, tokens: Sequence[int], start: int, key: int | None = None) -> SeqChunk:
        """The step's :class:`~mla_compile.models.metadata.SeqChunk` that writes ``tokens`` of ``alloc``'s sequence
        from position ``start`` (``key``: the request id the keyed ``MetadataBuilder`` tracks decode rows by)."""
        return SeqChunk(alloc.blocks, list(tokens), start, key=key)

    def uses(self, alloc: Allocation, made: Sequence[Sequence[int]]) -> bool:
        """Whether ``alloc`` holds a block of ``made`` (what :meth:`register` calls returned)."""
        ids = {b for m in made for b in m}
        return any(b in ids for b in alloc.blocks)

    def free(self, alloc: Allocation) -> None:
        """Release a finished sequence: cached blocks become evictable (LRU), the rest free."""
        for bid in reversed(alloc.blocks):  # tail blocks first, so prefix blocks stay cached longest
            if bid != self.null_block:
                self._unref(bid)
        alloc.blocks = []
        self.reserved -= alloc.reserved
        if self.sink_window is not None:
            self.claimed -= alloc.held + alloc.reserved
        alloc.reserved = alloc.released = alloc.held = 0


def _check_sink_window(sink_window: Any) -> tuple[int, int]:
    """``(sink, window)`` as the model takes them (:func:`mla_compile.models.config.check_sink_window`)."""
    if not (isinstance(sink_window, tuple) and len(sink_window) == 2):
        raise ValueError(f"sink_window must be a tuple (sink, window), got {sink_window!r}")
    return check_sink_window(*sink_window)


def sink_window_of(runner: Any) -> tuple[int, int] | None:
    """The ``(sink, window)`` of the model a runner steps (``runner.step_fn``, a ``torch.compile`` wrapper looked
    through; set by ``patch(..., sparse="sink_window")``), or None for a dense model, and for a model whose cache
    is split by token over DCP ranks (``parallel_state.config.dcp > 1``): a rank's part of a sequence sits in the
    first blocks of the shared table (:func:`mla_compile.parallel.dcp.localize`), so a block outside the global
    window may still hold another rank's window tokens; such an engine keeps every block (dense accounting; its
    attention still reads only the sink and window tokens)."""
    fn = getattr(runner, "step_fn", None)
    model = getattr(fn, "_orig_mod", fn)
    state = getattr(model, "parallel_state", None)
    if getattr(getattr(state, "config", None), "dcp", 1) > 1:
        return None
    value = getattr(model, "sink_window", None)
    return tuple(value) if isinstance(value, (tuple, list)) else None
