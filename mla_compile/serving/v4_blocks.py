"""The caches of DeepSeek-V4 sequences on the host, between steps: what
:class:`~mla_compile.serving.engine.Engine` drives for a V4 runner.

:class:`V4BlockManager` keeps them with bounded token-row memory: every V4 layer reads its token rows only
through its sliding window, so they live in a windowed :class:`~mla_compile.serving.block_manager.BlockManager`
(``sink_window=(0, sliding_window)``) that releases the blocks a sequence's window has left; the compressed
entries are kept whole, one compressor-state row per sequence; prefix hits restore compressor-state snapshots.
:class:`V4Blocks` is the same by sequence id, for loops that drive steps themselves. Both hand out
:class:`~mla_compile.serving.v4_builder.V4Chunk` s for :class:`~mla_compile.serving.v4_builder.V4DecodeBuilder`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from mla_compile.serving.block_manager import Allocation, BlockManager
from mla_compile.serving.v4_builder import V4Chunk


@dataclass
class V4Allocation:
    """A V4 sequence's cache: its token-row blocks (``tokens``, windowed), its compressed-entry blocks per rate
    (``entries``) and its compressor-state row (``state_slot``; None once freed). ``cached_tokens``: prompt tokens
    taken from the prefix cache (0 without a hit); ``snapshot``: the key of the snapshot restored (None: none)."""

    tokens: Allocation
    entries: dict[int, Allocation]
    state_slot: int | None
    cached_tokens: int = 0
    snapshot: Any = None

    @property
    def blocks(self) -> list[int]:
        """The token-row blocks (released ones hold the token manager's ``null_block``)."""
        return self.tokens.blocks


@dataclass
class _Snapshot:
    """A prefix's compressor state: ``tokens`` (the prefix), its copy of every compressor's state in state row
    ``row``, and copies of the partly filled entry block of each rate at the prefix's end (one block each)."""

    tokens: tuple[int, ...]
    row: int
    entry_blocks: dict[int, Allocation]


@dataclass
class _Made:
    """What one :meth:`V4BlockManager.register` made findable: token blocks, entry blocks per rate, a snapshot's
    key (None: none taken)."""

    tokens: list[int]
    entries: dict[int, list[int]]
    snapshot: Any = None


def _entry_keys(tokens: Sequence[int], rate: int) -> list[tuple[int, ...]]:
    """One key per complete compressed entry of ``tokens``: the ``rate`` tokens it closes."""
    return [tuple(tokens[j * rate:(j + 1) * rate]) for j in range(len(tokens) // rate)]


class V4BlockManager:
    """The cache of V4 sequences, with the block-manager interface :class:`~mla_compile.serving.engine.Engine`
    drives (``allocate``, ``grow``, ``register``, ``release_outside``, ``free``, ``chunk``, ``prefill_chunk``).
    Host-side, between steps.

    Token rows (``num_blocks`` blocks of ``block_size``, the model's ``allocate_cache(num_blocks, ...)``) go
    through a windowed :class:`~mla_compile.serving.block_manager.BlockManager` with ``sink_window=(0, window)``
    (``window``: the model's ``sliding_window``; every V4 layer reads its token rows only through it):
    :meth:`release_outside` gives back the blocks wholly before the window of a sequence's next token, their table
    entries pointing at the manager's ``null_block`` (block 0, never read), so a sequence holds at most its prompt's
    blocks or a window's plus one, however long it runs. Compressed entries (``num_entry_blocks`` per rate, one
    row per ``rate`` tokens, taken whole at :meth:`allocate`) and one compressor-state row (of ``max_seqs``) per
    sequence are kept until :meth:`free`: memory per sequence is the window plus its compressed entries.

    Prefix caching (``enable_prefix_caching``; needs ``model``, whose rows it copies): a hit must leave the new
    sequence exactly where computing its prefix would, and the compressors' partial-window state at a position is
    only known right after a step that ended there. So the manager keeps *snapshots*: when a prompt chunk ends at
    a multiple of ``snapshot_every`` (the lcm of the block size and the compression rates, so token blocks are
    full there) it copies the sequence's state row (and the partly filled entry block of each rate) aside, keyed
    by the prefix; :meth:`prefill_chunk` ends prompt chunks at such positions (a chunk that does not finish the
    prompt, and the last one split at the prompt's last such position). A new prompt reuses the longest prefix
    that has a snapshot and whose token blocks and full entry blocks are all still cached (rounded down from any
    shared prefix, e.g. one ending mid-window): shared full blocks, the snapshot's state row and partial entry
    blocks copied into its own; it computes the rest. Snapshots take state rows and entry blocks nobody else
    uses and are evicted (least recently used first) when a new sequence needs them: give the model
    ``max_seqs`` above the running batch to keep some.
    """

    def __init__(self, *, num_blocks: int, num_entry_blocks: int | dict[int, int], rates: Sequence[int],
                 block_size: int, window: int, max_seqs: int, max_entry_blocks_per_seq: int | None = None,
                 enable_prefix_caching: bool = False, model: Any = None) -> None:
        if enable_prefix_caching and not callable(getattr(model, "copy_cache_rows", None)):
            raise ValueError("V4 prefix caching needs the model (a V4ForCausalLM) to copy compressor state; pass "
                             "model=, or enable_prefix_caching=False")
        if max_seqs < 1:
            raise ValueError(f"max_seqs (compressor-state rows) must be >= 1, got {max_seqs}")
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.model = model
        self.tokens = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                   sink_window=(0, window))
        per_rate = num_entry_blocks if isinstance(num_entry_blocks, dict) else {r: num_entry_blocks for r in rates}
        missing = [r for r in rates if r not in per_rate]
        if missing:
            raise ValueError(f"num_entry_blocks has no count for compression rate {missing[0]}")
        self.entries = {r: BlockManager(per_rate[r], block_size, enable_prefix_caching=enable_prefix_caching)
                        for r in rates}
        self.max_entry_blocks = max_entry_blocks_per_seq
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.snapshot_every = math.lcm(block_size, *rates)
        self.snapshots: OrderedDict[int, _Snapshot] = OrderedDict()  # chain key of the prefix -> snapshot, LRU first

    @classmethod
    def for_runner(cls, runner: Any, *, num_blocks: int, num_entry_blocks: int | dict[int, int] | None = None,
                   enable_prefix_caching: bool = False) -> "V4BlockManager":
        """The manager of a V4 runner (``runner.builder`` a :class:`V4DecodeBuilder`, ``runner.step_fn`` the
        :class:`~mla_compile.models.v4_model.V4ForCausalLM` or ``torch.compile`` of it, its caches allocated):
        the window from the model's config, entry blocks per rate (default: all the model allocated) and
        compressor-state rows from its caches. Raises ``ValueError`` when the sizes exceed what was allocated."""
        fn = getattr(runner, "step_fn", None)
        model = getattr(fn, "_orig_mod", fn)
        sizes = model.cache_sizes() if callable(getattr(model, "cache_sizes", None)) else None
        if sizes is None:
            raise ValueError(f"a V4 engine needs the runner's step_fn to be a V4ForCausalLM (or torch.compile of one) "
                             f"with allocate_cache() done; got {type(model).__name__}"
                             + ("" if model is None or not hasattr(model, "cache_sizes") else " without caches"))
        b = runner.builder
        model_blocks, model_bs, model_entries, model_seqs = sizes
        if model_bs != b.block_size:
            raise ValueError(f"the model's caches have block_size {model_bs}, the builder {b.block_size}")
        if num_blocks > model_blocks:
            raise ValueError(f"num_blocks={num_blocks} exceeds the {model_blocks} token-row blocks the model allocated")
        if num_entry_blocks is None:
            num_entry_blocks = model_entries
        per_rate = num_entry_blocks if isinstance(num_entry_blocks, dict) else {r: num_entry_blocks for r in b.rates}
        for r in b.rates:
            if per_rate.get(r, 0) > model_entries.get(r, 0):
                raise ValueError(f"num_entry_blocks[{r}]={per_rate.get(r)} exceeds the {model_entries.get(r, 0)} "
                                 f"entry blocks of rate {r} the model allocated")
        return cls(num_blocks=num_blocks, num_entry_blocks=per_rate, rates=b.rates, block_size=b.block_size,
                   window=model.config.sliding_window, max_seqs=model_seqs if b.rates else b.max_batch,
                   max_entry_blocks_per_seq=b.max_entry_blocks, enable_prefix_caching=enable_prefix_caching,
                   model=model)

    # the token manager's figures (what the engine's admission limits read)
    @property
    def sink_window(self) -> tuple[int, int] | None:
        return self.tokens.sink_window

    @property
    def usable_blocks(self) -> int:
        return self.tokens.usable_blocks

    @property
    def num_free(self) -> int:
        return self.tokens.num_free

    @property
    def null_block(self) -> int | None:
        return self.tokens.null_block

    def peak_blocks(self, prompt_len: int, capacity: int) -> int:
        """Token-row blocks a sequence holds at once (:meth:`BlockManager.peak_blocks` of the windowed manager)."""
        return self.tokens.peak_blocks(prompt_len, capacity)

    def peak_tokens(self, prompt_len: int, capacity: int) -> int:
        """Token rows a sequence holds at once (:meth:`BlockManager.peak_tokens` of the windowed manager)."""
        return self.tokens.peak_tokens(prompt_len, capacity)

    def _entries(self, capacity: int, rate: int) -> int:
        """Entry rows of ``rate`` a sequence reaching ``capacity`` tokens is given (with prefix caching one more:
        a hit's entry list holds a placeholder after its reused entries)."""
        return max(capacity // rate + self.prefix_caching, 1)

    def entry_blocks(self, capacity: int) -> dict[int, int]:
        """Entry blocks per rate a sequence reaching ``capacity`` tokens takes."""
        return {r: -(-self._entries(capacity, r) // self.block_size) for r in self.entries}

    def never_fits(self, prompt_len: int, capacity: int) -> str | None:
        """Why a sequence of ``capacity`` tokens can never be admitted, even into an empty cache (its compressed
        entries exceed a rate's whole entry cache or one sequence's entry table), or None."""
        for r, n in self.entry_blocks(capacity).items():
            for limit, what in ((len(self.entries[r].blocks), "the entry cache of rate"),
                                (self.max_entry_blocks, "the builder's max_entry_blocks for rate")):
                if limit is not None and n > limit:
                    return (f"{capacity} tokens need {n} compressed-entry blocks of rate {r}, more than {what} "
                            f"{r} ({limit} blocks of {self.block_size} entries)")
        return None

    def _hit(self, tokens: Sequence[int]) -> tuple[int, _Snapshot | None]:
        """The longest reusable prefix of prompt ``tokens``: ``(length, its snapshot)``, or ``(0, None)``."""
        if not self.prefix_caching or not self.snapshots:
            return 0, None
        bs, every = self.block_size, self.snapshot_every
        n = self.tokens.cached_blocks(tokens)  # full token blocks of tokens[:-1] still cached
        keys = self.tokens.chain_keys(tokens, n)
        for L in range(n * bs // every * every, 0, -every):
            snap = self.snapshots.get(keys[L // bs - 1])
            if snap is None or snap.tokens != tuple(tokens[:L]):
                continue
            if all(m.cached_blocks(_entry_keys(tokens[:L], r) + [None]) >= (L // r) // bs
                   for r, m in self.entries.items()):
                return L, snap
        return 0, None

    def _evict_snapshot(self, keep: _Snapshot | None = None) -> bool:
        """Drop the least recently used snapshot other than ``keep``; False when there is none."""
        for key, snap in self.snapshots.items():
            if snap is not keep:
                del self.snapshots[key]
                self.free_slots.append(snap.row)
                for r, a in snap.entry_blocks.items():
                    self.entries[r].free(a)
                return True
        return False

    def allocate(self, tokens: Sequence[int], capacity: int | None = None) -> V4Allocation:
        """Cache for a new sequence with prompt ``tokens`` that may reach ``capacity`` tokens: its prompt's token
        blocks and all its entry blocks now (the longest reusable prefix's shared, its snapshot's state and partial
        entry blocks copied in), the rest of its token peak reserved, a compressor-state row. Snapshots are evicted
        for the room it needs. Raises ``RuntimeError`` (nothing taken) when it does not fit now."""
        capacity = len(tokens) if capacity is None else capacity
        if not 1 <= len(tokens) <= capacity:
            raise ValueError(f"need a non-empty prompt and capacity >= len(tokens), got {len(tokens)} and {capacity}")
        L, snap = self._hit(tokens)
        need = {r: n - (L // r) // self.block_size for r, n in self.entry_blocks(capacity).items()}
        while (not self.free_slots or any(n > self.entries[r].num_free for r, n in need.items())) \
                and self._evict_snapshot(keep=snap):
            pass
        if not self.free_slots:
            raise RuntimeError("no free compressor-state row: every one of max_seqs is in use")
        short = [r for r, n in need.items() if n > self.entries[r].num_free]
        if short:
            raise RuntimeError(f"entry cache of rate {short[0]} is full: need {need[short[0]]} blocks")
        alloc = self.tokens.allocate(tokens, capacity, max_cached=L)  # raises before anything else is taken
        assert alloc.cached_tokens == L, (alloc.cached_tokens, L)
        entries: dict[int, Allocation] = {}
        try:
            for r, m in self.entries.items():
                entries[r] = m.allocate(_entry_keys(tokens[:L], r) + [None], self._entries(capacity, r))
                assert entries[r].cached_tokens == (L // r) // self.block_size * self.block_size
        except RuntimeError:  # an entry cache short after all (hits on evictable blocks): give everything back
            self.tokens.free(alloc)
            for r, a in entries.items():
                self.entries[r].free(a)
            raise
        seq = V4Allocation(alloc, entries, self.free_slots.pop(), cached_tokens=L)
        if snap is not None:  # the snapshot's state and partial entry blocks into the new sequence's own
            seq.snapshot = self.tokens.chain_keys(tokens, L // self.block_size)[-1]
            self.snapshots.move_to_end(seq.snapshot)
            partial = {r: [(a.blocks[0], entries[r].blocks[(L // r) // self.block_size])]
                       for r, a in snap.entry_blocks.items()}
            self.model.copy_cache_rows([(snap.row, seq.state_slot)], partial)
        return seq

    def grow(self, alloc: V4Allocation, capacity: int) -> None:
        """Token blocks for ``capacity`` tokens (from the sequence's reservation)."""
        self.tokens.grow(alloc.tokens, capacity)

    def prefill_chunk(self, start: int, n: int, prompt_len: int) -> int:
        """With prefix caching, a prompt chunk ends where a snapshot can be taken: at the last multiple of
        ``snapshot_every`` it reaches (when the prompt goes on past it, or when one lies before the prompt's last
        token: the last chunk is split there); else all ``n`` tokens."""
        if not self.prefix_caching:
            return n
        end = start + n
        cut = (end if end < prompt_len else prompt_len - 1) // self.snapshot_every * self.snapshot_every
        return cut - start if cut > start else n

    def register(self, alloc: V4Allocation, tokens: Sequence[int]) -> _Made:
        """After the prompt's first ``len(tokens)`` tokens are in the cache (their step succeeded): make its full
        token and entry blocks findable, and at a multiple of ``snapshot_every`` take a snapshot of its state (when
        a state row, and an entry block per rate it needs, are free or held by older snapshots). Returns what it
        made findable, for :meth:`forget`."""
        made = _Made([], {})
        if not self.prefix_caching:
            return made
        made.tokens = self.tokens.register(alloc.tokens, tokens)
        for r, m in self.entries.items():
            made.entries[r] = m.register(alloc.entries[r], _entry_keys(tokens, r))
        L, bs = len(tokens), self.block_size
        if L == 0 or L % self.snapshot_every:
            return made
        key = self.tokens.chain_keys(tokens, L // bs)[-1]
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return made
        partial = [r for r in self.entries if (L // r) % bs]
        while (not self.free_slots or any(self.entries[r].num_free < 1 for r in partial)) and self._evict_snapshot():
            pass
        if not self.free_slots or any(self.entries[r].num_free < 1 for r in partial):
            return made  # no room: no snapshot
        row = self.free_slots.pop()
        blocks = {r: self.entries[r].allocate([None], 1) for r in partial}
        self.model.copy_cache_rows([(alloc.state_slot, row)],
                                   {r: [(alloc.entries[r].blocks[(L // r) // bs], a.blocks[0])]
                                    for r, a in blocks.items()})
        self.snapshots[key] = _Snapshot(tuple(tokens), row, blocks)
        made.snapshot = key
        return made

    def uses(self, alloc: V4Allocation, made: Sequence[_Made]) -> bool:
        """Whether ``alloc`` holds a token or entry block of ``made`` (what :meth:`register` calls returned) or was
        restored from a snapshot one of them took."""
        if alloc.state_slot is None:
            return False
        if self.tokens.uses(alloc.tokens, [m.tokens for m in made]):
            return True
        if any(self.entries[r].uses(a, [m.entries.get(r, []) for m in made]) for r, a in alloc.entries.items()):
            return True
        return alloc.snapshot is not None and any(m.snapshot == alloc.snapshot for m in made)

    def forget(self, made: _Made) -> None:
        """Undo a :meth:`register` whose step failed: its blocks are no longer findable and its snapshot is gone."""
        self.tokens.forget(made.tokens)
        for r, ids in made.entries.items():
            self.entries[r].forget(ids)
        snap = self.snapshots.pop(made.snapshot, None) if made.snapshot is not None else None
        if snap is not None:
            self.free_slots.append(snap.row)
            for r, a in snap.entry_blocks.items():
                self.entries[r].free(a)

    def release_outside(self, alloc: V4Allocation, next_pos: int) -> int:
        """Release the token blocks the window of a query at ``next_pos`` has left; returns how many."""
        return self.tokens.release_outside(alloc.tokens, next_pos)

    def free(self, alloc: V4Allocation | Allocation) -> None:
        """Give back everything ``alloc`` holds (a no-op for one already freed, or never allocated); its registered
        blocks stay in the prefix cache until evicted."""
        if not isinstance(alloc, V4Allocation) or alloc.state_slot is None:
            return
        self.tokens.free(alloc.tokens)
        for r, a in alloc.entries.items():
            self.entries[r].free(a)
        self.free_slots.append(alloc.state_slot)
        alloc.state_slot = None

    def chunk(self, alloc: V4Allocation, tokens: Sequence[int], start: int, key: int | None = None) -> V4Chunk:
        """The :class:`V4Chunk` that writes ``tokens`` from position ``start`` (blocks must already cover them;
        ``key`` is not used: the V4 builder keeps no host tables by request)."""
        return V4Chunk(list(tokens), start, list(alloc.tokens.blocks),
                       {r: list(a.blocks) for r, a in alloc.entries.items()}, alloc.state_slot)


class V4Blocks:
    """Block lists of V4 sequences by id over one model's caches (host-side, between steps): a
    :class:`V4BlockManager` that also tracks each sequence's length, for loops that drive steps themselves."""

    def __init__(self, *, num_blocks: int, num_entry_blocks: int | dict[int, int], rates: Sequence[int],
                 block_size: int, window: int, max_seqs: int) -> None:
        self.manager = V4BlockManager(num_blocks=num_blocks, num_entry_blocks=num_entry_blocks, rates=rates,
                                      block_size=block_size, window=window, max_seqs=max_seqs)
        self.block_size = block_size
        self.tokens, self.entries = self.manager.tokens, self.manager.entries
        self.seqs: dict[int, V4Allocation] = {}
        self.lens: dict[int, int] = {}

    @property
    def free_slots(self) -> list[int]:
        return self.manager.free_slots

    def add(self, seq_id: int, prompt_len: int, capacity: int) -> None:
        """Admit sequence ``seq_id`` of a ``prompt_len``-token prompt that may reach ``capacity`` tokens
        (:meth:`V4BlockManager.allocate`). Raises ``RuntimeError`` (nothing taken) when it does not fit,
        ``ValueError`` for a known id or bad lengths."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} is already added")
        if not 1 <= prompt_len <= capacity:
            raise ValueError(f"need 1 <= prompt_len <= capacity, got {prompt_len} and {capacity}")
        self.seqs[seq_id] = self.manager.allocate([0] * prompt_len, capacity)
        self.lens[seq_id] = 0

    def chunk(self, seq_id: int, tokens: Sequence[int]) -> V4Chunk:
        """The :class:`V4Chunk` that appends ``tokens`` to sequence ``seq_id`` (its token blocks grown to cover
        them); call :meth:`commit` after the step ran."""
        alloc, start = self.seqs[seq_id], self.lens[seq_id]
        self.manager.grow(alloc, start + len(tokens))
        return self.manager.chunk(alloc, tokens, start)

    def commit(self, seq_id: int, n_tokens: int) -> int:
        """After a step appended ``n_tokens`` to ``seq_id``: advance it and release its token blocks that the
        window of its next token has left. Returns how many blocks were released."""
        self.lens[seq_id] += n_tokens
        return self.manager.release_outside(self.seqs[seq_id], self.lens[seq_id])

    def free(self, seq_id: int) -> None:
        """Give back everything sequence ``seq_id`` holds."""
        self.manager.free(self.seqs.pop(seq_id))
        del self.lens[seq_id]
