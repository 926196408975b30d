"""A persistent decode batch on the host: one row per decoding sequence, updated in place between steps.

Handing a decode step to :meth:`~mla_compile.serving.builder.MetadataBuilder.build` as B
:class:`~mla_compile.models.metadata.SeqChunk` objects costs per-row Python every step (making them, then
reading them back), though from one step to the next every sequence only advances by one token and now and
then gains a block. :class:`DecodeRows` keeps the batch as numpy arrays in batch order (row ``i`` is the
``i``-th decode sequence of the step): each row's key, input token, position, generation step, block count,
block table and sampling parameters. A step that keeps its sequences (the usual one) changes them with a few
whole-batch numpy operations (:meth:`DecodeRows.advance`, :meth:`DecodeRows.set_blocks` for a row that gained
a block), and the builder builds the step straight from the arrays. Rows are rearranged
(:meth:`DecodeRows.arrange`) only when sequences join or leave the batch.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np

from mla_compile.models.metadata import SeqChunk


class RowState(NamedTuple):
    """What a new row starts from: the sequence's block list (the list object, as its owner keeps it), its next
    input token, the position that token is written at, the index of the token the step draws, and its
    sampling parameters (an object with ``temperature``, ``top_k``, ``top_p`` and a set ``seed``), and the
    logits row of the previous step whose token feeds it (-1: none; see :attr:`DecodeRows.fed`)."""

    blocks: Sequence[int]
    token: int
    position: int
    step: int
    params: Any
    fed: int = -1


class DecodeRows:
    """The decode rows of a step, at most ``max_rows`` of ``max_blocks`` blocks of ``block_size`` tokens each,
    one token per row per step, kept between steps.

    Arrays (``[max_rows]``, the first ``len(self)`` entries in use, in batch order): :attr:`tokens`,
    :attr:`positions` (where each row's token is written: the sequence holds ``positions + 1`` tokens after the
    step), :attr:`steps` (the index of the token each row draws), :attr:`block_counts`, :attr:`capacity` (the
    tokens its blocks hold), :attr:`table` (int32 ``[max_rows, max_blocks]``, zero past a row's blocks),
    :attr:`fed` (the logits row of the previous step whose sampled token is the row's input, or -1: an
    engine's token feed), and the sampling columns :attr:`temperature`, :attr:`top_k`, :attr:`top_p`,
    :attr:`seeds`. They are views of two packed arrays, so a step touches each with few numpy calls:
    :attr:`packed` (int64 ``[6, max_rows]``: temperature and top_p as float64 bits, top_k, seeds, steps in the
    row order of :class:`~mla_compile.serving.sampling.SamplingRows`, then positions) and :attr:`inputs`
    (tokens, fed). :attr:`keys` names each row (hashable, unique), :attr:`block_lists` holds each row's block
    list object.

    Contract: a row's table equals its block list as of the last :meth:`arrange` (for a new row) or
    :meth:`set_blocks` of it; whoever changes a sequence's block list calls :meth:`set_blocks` for its row. As
    for :class:`~mla_compile.serving.host_tables.HostBlockTables`, a list changed in place since the row's last
    write must only have been appended to (or truncated): any other in-place change is passed as another list
    object (what :class:`~mla_compile.serving.block_manager.BlockManager` does).
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int) -> None:
        for name, value in (("max_rows", max_rows), ("max_blocks", max_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.block_counts = np.zeros(max_rows, dtype=np.int64)
        self.capacity = np.zeros(max_rows, dtype=np.int64)
        self.packed = np.zeros((6, max_rows), dtype=np.int64)
        self.temperature, self.top_k = self.packed[0].view(np.float64), self.packed[1]
        self.top_p, self.seeds, self.steps = self.packed[2].view(np.float64), self.packed[3], self.packed[4]
        self.positions = self.packed[5]
        self.inputs = np.zeros((2, max_rows), dtype=np.int64)
        self.tokens, self.fed = self.inputs[0], self.inputs[1]
        self._fed_inputs = np.stack([np.zeros(max_rows, dtype=np.int64), np.arange(max_rows, dtype=np.int64)])
        self.clear()

    def clear(self) -> None:
        """Drop every row."""
        self.n = 0
        self.keys: list[Hashable] = []
        self.block_lists: list[Sequence[int]] = []
        self.params: list[Any] = []
        self._index: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return self.n

    def row_of(self, key: Hashable) -> int | None:
        """The row of ``key`` (None: not in the batch)."""
        return self._index.get(key)

    def arrange(self, keys: Sequence[Hashable], new_row: Callable[[int], RowState]) -> None:
        """Make the rows those of ``keys``, in that order: a key already here keeps its row's state (moved to
        its new place), a new key's row ``i`` starts from ``new_row(i)``; keys not in ``keys`` leave. A no-op
        when ``keys`` equals :attr:`keys`. Raises ``ValueError`` (changing nothing) for more keys than rows, a
        repeated key, a new row's negative position or block list longer than ``max_blocks`` (a row whose
        blocks do not reach its position yet is fine: see :meth:`short`)."""
        keys = list(keys)
        if keys == self.keys:
            return
        n = len(keys)
        if n > self.max_rows:
            raise ValueError(f"{n} decode rows exceed the batch's max_rows={self.max_rows}")
        index = dict(zip(keys, range(n)))
        if len(index) != n:
            raise ValueError(f"decode row keys must be unique, got {keys}")
        old = np.fromiter(map(self._index.get, keys, [-1] * n), np.int64, n)
        new = np.flatnonzero(old < 0).tolist()
        states = [new_row(i) for i in new]
        lens = np.fromiter((len(s.blocks) for s in states), np.int64, len(states))
        pos = np.fromiter((s.position for s in states), np.int64, len(states))
        if ((lens > self.max_blocks) | (pos < 0)).any():
            bad = int(np.flatnonzero((lens > self.max_blocks) | (pos < 0))[0])
            raise ValueError(f"decode row {new[bad]} (key {keys[new[bad]]!r}): position {int(pos[bad])} with "
                             f"{int(lens[bad])} blocks of {self.block_size} (at most max_blocks={self.max_blocks})")
        rows = np.empty((len(new), self.max_blocks), dtype=np.int32)
        for j, s in enumerate(states):  # ids checked as int32 before anything changes
            rows[j, :lens[j]] = np.fromiter(s.blocks, np.int32, int(lens[j]))
            rows[j, lens[j]:] = 0
        kept = np.flatnonzero(old >= 0)
        src = old[kept]
        for a in (self.block_counts, self.capacity, self.table):
            a[kept] = a[src]  # a gather first (fancy indexing copies), then the store
        for a in (self.packed, self.inputs):
            a[:, kept] = a[:, src]
        lists, params = self.block_lists, self.params
        self.block_lists = [lists[o] if o >= 0 else None for o in old.tolist()]
        self.params = [params[o] if o >= 0 else None for o in old.tolist()]
        for j, (i, s) in enumerate(zip(new, states)):
            self.table[i] = rows[j]
            self.block_counts[i], self.capacity[i] = lens[j], lens[j] * self.block_size
            self.tokens[i], self.positions[i], self.steps[i], self.fed[i] = s.token, s.position, s.step, s.fed
            p = s.params
            self.temperature[i], self.top_k[i], self.top_p[i], self.seeds[i] = p.temperature, p.top_k, p.top_p, p.seed
            self.block_lists[i], self.params[i] = s.blocks, p
        self.keys, self.n, self._index = keys, n, index

    def short(self) -> np.ndarray:
        """The rows whose blocks do not hold their position (they need a block before the step)."""
        n = self.n
        return (self.positions[:n] >= self.capacity[:n]).nonzero()[0]

    def set_blocks(self, row: int, blocks: Sequence[int]) -> None:
        """Rewrite ``row``'s table from ``blocks`` (its sequence's block list now: another object, or the same one
        appended to or truncated, see the class contract); the same list grown by one block writes only its new id.
        Raises ``ValueError`` for more than ``max_blocks`` blocks, changing nothing."""
        k = len(blocks)
        if k > self.max_blocks:
            raise ValueError(f"decode row {row}: {k} blocks exceed max_blocks={self.max_blocks}")
        held = int(self.block_counts[row])
        if k == held + 1 and blocks is self.block_lists[row]:  # the usual change: one block appended
            self.table[row, held] = blocks[held]
        else:
            ids = np.fromiter(blocks, np.int32, k)
            self.table[row, :k] = ids
            self.table[row, k:] = 0
        self.block_counts[row], self.capacity[row] = k, k * self.block_size
        self.block_lists[row] = blocks

    def advance(self, tokens: np.ndarray | None = None, fed: bool = False) -> None:
        """After a step: every row moves one token on (position and step + 1). ``tokens``: the rows' sampled
        tokens, their next inputs; None: placeholder 0. ``fed``: the next step feeds each row the token of its
        logits row in this step (:attr:`fed` = the row index), else :attr:`fed` = -1."""
        n = self.n
        self.packed[4:6, :n] += 1  # steps and positions
        if fed and tokens is None:
            self.inputs[:, :n] = self._fed_inputs[:, :n]
            return
        self.tokens[:n] = 0 if tokens is None else tokens[:n]
        self.fed[:n] = self._fed_inputs[1, :n] if fed else -1

    def sampling(self) -> dict[str, np.ndarray]:
        """The rows' sampling columns by :func:`~mla_compile.serving.sampling.sample`'s argument names."""
        n = self.n
        return dict(temperature=self.temperature[:n], top_k=self.top_k[:n], top_p=self.top_p[:n],
                    seeds=self.seeds[:n], steps=self.steps[:n])

    def sampling_packed(self) -> np.ndarray:
        """The rows' sampling columns packed as :class:`~mla_compile.serving.sampling.SamplingRows` holds them
        (int64 ``[5, len(self)]``, floats as float64 bits): one copy fills its host buffer."""
        return self.packed[:5, :self.n]

    def chunks(self) -> list[SeqChunk]:
        """The rows as keyed decode :class:`~mla_compile.models.metadata.SeqChunk` objects (the general
        builder path: mixed steps, padding to a data-parallel shape)."""
        n = self.n
        return [SeqChunk(b, [t], p, key=k) for b, t, p, k in
                zip(self.block_lists, self.tokens[:n].tolist(), self.positions[:n].tolist(), self.keys)]
