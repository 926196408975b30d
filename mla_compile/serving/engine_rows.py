"""The engine's row bookkeeping: its running list with a version that changes with it (:class:`RunningList`), the
rows of a launched step that feed the next one (:class:`FedRows`), and the vectorised read of a decode-only step's
tokens (:class:`DecodeView`, :func:`decode_view`, :func:`take_rows`)."""

from __future__ import annotations

import itertools
from collections import deque
from itertools import repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from mla_compile.serving.requests import Request

_VERSIONS = itertools.count()


class RunningList(list):
    """The engine's running requests: a list whose :attr:`version` changes with every change of it (and with every
    request that starts decoding: :meth:`touch`, called by the engine), to a value no list of any engine had
    before, so work that depends only on it is redone only then."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.version = next(_VERSIONS)

    def touch(self) -> None:
        """Mark a change the list cannot see (a request's prefilling state)."""
        self.version = next(_VERSIONS)

    def index_of(self, item: Any) -> int:
        """The index of ``item`` itself, or -1: compared by identity (``in`` and ``remove`` compare by ``==``, which for
        a dataclass builds and compares the field tuples of every request before it)."""
        try:
            return list(map(is_, self, repeat(item))).index(True)
        except ValueError:
            return -1

    def drop(self, item: Any) -> bool:
        """Remove ``item`` itself (see :meth:`index_of`); returns whether it was there."""
        i = self.index_of(item)
        if i < 0:
            return False
        del self[i]
        return True

    def _changed(method):  # noqa: N805 - a decorator of the methods below
        def changed(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            self.version = next(_VERSIONS)
            return out
        changed.__name__ = method.__name__
        return changed

    append, remove, insert, pop, extend, clear = map(_changed, (list.append, list.remove, list.insert, list.pop,
                                                               list.extend, list.clear))
    sort, reverse = _changed(list.sort), _changed(list.reverse)
    __setitem__, __delitem__, __iadd__ = _changed(list.__setitem__), _changed(list.__delitem__), \
        _changed(list.__iadd__)
    del _changed


class FedRows(dict):
    """Request id -> the logits row of a launched step whose token is that request's next input, made from the
    step's ``yields`` on first use (most steps never look one up)."""

    def __init__(self, yields: list[tuple[int, Request]]) -> None:
        super().__init__()
        self._yields = yields

    def _fill(self) -> None:
        if self._yields is not None:
            self.update((r.id, row) for row, r in self._yields)
            self._yields = None

    def get(self, key, default=None):
        self._fill()
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._fill()
        return super().__contains__(key)


_ID, _OUTPUT, _MAX_NEW = attrgetter("id"), attrgetter("output"), attrgetter("max_new_tokens")
_STOPS = attrgetter("params.stop_token_ids")
finish_reason_of = attrgetter("finish_reason")


class DecodeView(NamedTuple):
    """The decode rows of one ``decoding`` list (:func:`decode_view`): the ``requests`` in row order, their
    ``(row, request)`` pairs, output lists and ids, the index of each one's last token (``max_new_tokens - 1``,
    int64 ``[n]``) and its stop token ids (int64 ``[n, k]``, -1 padded; None: no row has any)."""

    requests: list[Request]
    yields: list[tuple[int, Request]]
    outputs: list[list[int]]
    ids: list[int]
    final: np.ndarray
    stops: np.ndarray | None

    def last_rows(self, steps: np.ndarray) -> list[int]:
        """The rows that draw their request's last token (``max_new_tokens``) in a step where row ``i`` draws the
        token of index ``steps[i]`` (``DecodeRows.steps`` before the step's advance), ascending."""
        return (steps[:len(self.ids)] >= self.final).nonzero()[0].tolist()


def decode_view(decoding: list[Request]) -> DecodeView:
    """What reading the tokens of a decode-only step of ``decoding`` (the decode rows, in row order) needs (the
    engine makes it once per ``decoding`` list: a new one whenever the running requests change)."""
    n = len(decoding)
    stop_sets = list(map(_STOPS, decoding))
    width = max(map(len, stop_sets), default=0)
    stops = None
    if width:  # -1 pads (token ids are >= 0)
        stops = np.full((n, width), -1, dtype=np.int64)
        if min(map(len, stop_sets)) == width:
            stops[:] = stop_sets
        else:
            for i, ids in enumerate(stop_sets):
                stops[i, :len(ids)] = ids
    return DecodeView(decoding, list(enumerate(decoding)), list(map(_OUTPUT, decoding)), list(map(_ID, decoding)),
                      np.fromiter(map(_MAX_NEW, decoding), np.int64, n) - 1, stops)


def take_rows(view: DecodeView, tokens: np.ndarray, last: list[int], learned: dict[int, list[int]]
              ) -> list[Request]:
    """Take a decode-only step's tokens in one pass: row ``i``'s token ``tokens[i]`` goes to the end of its
    request's output and of ``learned[request id]``, in row order; returns the requests those tokens finished (a
    stop token, or ``max_new_tokens`` reached: among the rows ``last``, see :meth:`DecodeView.last_rows`), in
    row order, without finishing them. Every request of ``view`` must be unfinished."""
    n = len(view.ids)
    toks = tokens[:n]
    deque(map(list.append, view.outputs, toks.tolist()), 0)
    singles = toks.reshape(n, 1).tolist()  # [[t], ...]: each request's new tokens
    if learned:
        for key, new in zip(view.ids, singles):
            learned.setdefault(key, []).extend(new)
    else:
        learned.update(zip(view.ids, singles))
    ends = last
    if view.stops is not None:
        hit = (view.stops == toks[:, None]).any(1).nonzero()[0].tolist()
        if hit:
            ends = sorted({*last, *hit})
    return [r for r in map(view.requests.__getitem__, ends) if r.stopped or r.done]
