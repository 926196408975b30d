"""Persistent host block tables of keyed sequences, updated only where a sequence changed.

A decode step of B sequences with ~65 blocks each would otherwise re-pack B x 65 block ids from Python
lists every step, though each sequence only appended a token (and now and then one block).
:class:`HostBlockTables` keeps one int32 row per sequence key, across steps, and on each step writes
only what changed: a new block id where a sequence's list grew by one, the whole row where it grew by
more, shrank, or is another list object (a new sequence, or a key now naming another sequence). The
caller gathers the step's rows out of :attr:`HostBlockTables.table` in step order.
"""

from __future__ import annotations

from itertools import repeat
from operator import getitem, is_
from typing import Hashable, Sequence

import numpy as np

from mla_compile.models.metadata import fill_block_table


class HostBlockTables:
    """Block tables of at most ``rows`` keyed sequences, ``width`` ids each (int32, zero past a sequence's
    blocks), kept between steps.

    Contract of :meth:`update`: from one update to the next, a key's block list is the same object only
    appended to, or the same object only truncated, or another object (then its row is rewritten). Any
    other in-place change (an id overwritten, a list truncated and then appended to) needs :meth:`forget`
    of that key first: the tables compare only the list's identity and length. They hold a reference to
    each key's block list while the key is present, so no other list can take that identity meanwhile.
    """

    def __init__(self, rows: int, width: int) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.counts = np.zeros(rows, dtype=np.int64)  # block ids held in each row
        self.clear()

    def clear(self) -> None:
        """Drop every key (the next update rewrites the rows of its keys whole)."""
        rows = self.table.shape[0]
        self._row_of: dict[Hashable, int] = {}
        self._lists: list[Sequence[int] | None] = [None] * rows  # the block list each row holds
        self._free = list(range(rows - 1, -1, -1))
        self._keys: list[Hashable] = []  # the last update's keys, its rows and block lists, in order
        self._rows = np.zeros(0, dtype=np.int64)
        self._blocks: list[Sequence[int]] = []
        self._counts = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        """How many keys hold a row."""
        return len(self._row_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._row_of

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s row (its next update rewrites it from its block list); unknown keys are ignored."""
        row = self._row_of.pop(key, None)
        if row is not None:
            self._release(row)
            self._keys, self._rows, self._blocks, self._counts = [], self._rows[:0], [], self._counts[:0]

    def _release(self, row: int) -> None:
        self._lists[row] = None
        self._free.append(row)

    def update(self, keys: list[Hashable], blocks: list[Sequence[int]], counts: np.ndarray) -> np.ndarray | None:
        """Bring the rows of ``keys`` up to date with their ``blocks`` (``counts``: each list's length,
        int64, at most ``width``; checked by the caller) and return each key's row (int64 ``[len(keys)]``).
        Keys absent from this update leave (their rows are reused). Returns None, changing nothing, when
        a key is None. Raises ``ValueError`` for an unhashable or repeated key or more keys than rows,
        before changing anything; any other error (a block id that is not an int32) clears the tables
        and propagates."""
        n = len(keys)
        if keys == self._keys:  # the same sequences in the same order as the last update (the usual step)
            rows = self._rows
            if all(map(is_, blocks, self._blocks)):  # the same lists: only their lengths can have changed
                grow = counts - self._counts
                if grow.any():
                    self._grow(rows, blocks, counts, grow)
                self._counts = counts
                return rows
            fresh = np.flatnonzero(~np.fromiter(map(is_, blocks, self._blocks), bool, n))
        else:
            try:
                present = set(keys)
            except TypeError as exc:
                raise ValueError(f"sequence keys must be hashable ({exc})") from None
            if None in present:
                return None
            if n > self.table.shape[0]:
                raise ValueError(f"{n} keyed sequences exceed the tables' {self.table.shape[0]} rows")
            if len(present) != n:
                seen: set[Hashable] = set()
                for i, key in enumerate(keys):
                    if key in seen:
                        raise ValueError(f"decode sequence {i} repeats the key {key!r} of an earlier one: "
                                         "each key names one sequence")
                    seen.add(key)
            for key in self._row_of.keys() - present:
                self._release(self._row_of.pop(key))
            rows = np.fromiter(map(self._row_of.get, keys, repeat(-1)), np.int64, n)
            for i in np.flatnonzero(rows < 0).tolist():  # new keys take free rows
                rows[i] = self._row_of[keys[i]] = self._free.pop()
            held = list(map(self._lists.__getitem__, rows.tolist()))  # None for a new key's row
            fresh = np.flatnonzero(~np.fromiter(map(is_, blocks, held), bool, n))
        try:
            self._write(rows, blocks, counts, fresh)
        except BaseException:
            self.clear()
            raise
        self._keys, self._rows, self._blocks, self._counts = keys, rows, blocks, counts
        return rows

    def _grow(self, rows: np.ndarray, blocks: list[Sequence[int]], counts: np.ndarray, grow: np.ndarray) -> None:
        """The steady step: the last update's keys and lists, some lists now longer or shorter by ``grow``.
        A list grown by one block writes its new id; any other change rewrites the row (:meth:`_write`)."""
        changed = np.flatnonzero(grow)
        if (grow[changed] != 1).any():
            try:
                self._write(rows, blocks, counts, None)
            except BaseException:
                self.clear()
                raise
            return
        at = counts[changed] - 1
        try:
            ids = np.fromiter(map(getitem, map(blocks.__getitem__, changed.tolist()), at.tolist()), np.int32,
                              len(changed))
        except BaseException:
            self.clear()
            raise
        picked = rows[changed]
        self.table[picked, at] = ids
        self.counts[picked] = counts[changed]

    def _write(self, rows: np.ndarray, blocks: list[Sequence[int]], counts: np.ndarray,
               fresh: np.ndarray | None) -> None:
        """Write what changed: one id per row grown by one block, whole rows for ``fresh`` positions
        (another list object) and for rows grown by more or shrunk."""
        old = self.counts[rows]
        grow = counts - old
        if fresh is not None and len(fresh):
            grow[fresh] = -1  # rewrite these whole
        changed = np.flatnonzero(grow)
        if not len(changed):
            return
        one = changed[grow[changed] == 1]
        if len(one):
            at = old[one]
            ids = np.fromiter(map(getitem, map(blocks.__getitem__, one.tolist()), at.tolist()), np.int32, len(one))
            self.table[rows[one], at] = ids
        whole = changed[grow[changed] != 1]
        if len(whole):
            part = np.empty((len(whole), self.table.shape[1]), dtype=np.int32)
            picked = [blocks[i] for i in whole.tolist()]
            fill_block_table(part, picked, counts[whole])
            self.table[rows[whole]] = part
            for row, lst in zip(rows[whole].tolist(), picked):
                self._lists[row] = lst
        self.counts[rows[changed]] = counts[changed]
