"""Measured backend timings per shape class: the data "auto" ranks backends by.

A timing file (``ops/backend_timings/*.json``, written by ``benchmarks/bench_backends.py``) holds, for the
GPU it was measured on (name, compute capability, package versions), rows of one shape class each::

    {"op": "decode", "dtype": "bfloat16", "cache": "bfloat16", "heads": 16, "batch": 128, "context": 8192,
     "us": {"triton": 312.0, "flashmla": 332.9}, "shape": "B=128 L=8192 H=16", "source": "run 26"}

``heads``, ``batch`` (sequences of a decode or prefill, tokens of the other ops) and ``context`` (tokens
per sequence; the top-k of a sparse decode; the slots each query row lists in ``v4_attention``: a sliding
layer's window, a CSA layer's window + top-k, an HCA layer's window + entries) are bucket bounds from
:data:`BUCKETS` (a value goes to the smallest bound at or above it, or the largest); ``cache`` is the
cache format ("fp8" for the uint8 rows, else the cache dtype; the input dtype for ops without a cache);
``us`` is GPU time per call in microseconds (CUDA-graph replay).

A call may also name its ``capacity``: the most tokens any of its sequences can hold (a paged decode's block
table width times the page size: a static shape). No sequence of such a call is longer, so only the rows at
contexts up to the capacity's bucket are its class (a graph whose tables hold 4096 tokens is not ranked by
8192-token timings); without rows there, the rows at every context decide. A backend whose time follows the
capacity, not the lengths (``Backend.cost == "capacity"``, ``at_capacity`` here), costs its time at the capacity's
context in every row of the class (at the row's batch bucket).

:func:`rank` orders the backends that can serve a call: the fastest in the table for the call's class
first. A compiled graph serves every batch and context, so without them the class is (op, dtype, cache,
heads) and a backend's time is its sum over the rows of that class, among backends timed in every row
(a composite's time is its parts', per :attr:`~mla_compile.ops.registry.Backend.tiers`). A table applies
only to GPUs of its compute capability; a class without data keeps the declared static order (the
selector widens a graph's static context that has no rows to every context first).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

FORMAT = 1
BUCKETS: dict[str, tuple[int, ...]] = {"heads": (16, 32, 64, 128), "batch": (2, 16, 64, 128, 256),
                                       "context": (1024, 4096, 8192, 32768)}
# Ops whose "context" is a short listed-slot count (v4_attention: sliding 128, HCA ~192, CSA 640) get finer
# context buckets below 1024; every other op keeps 1024 as its smallest, so its rows and callers are unchanged.
FINE_CONTEXT: dict[str, tuple[int, ...]] = {"v4_attention": (128, 256, 512, 1024, 4096, 8192, 32768)}
FOLDER = Path(__file__).with_name("backend_timings")
# A split by batch is made only where the class's overall winner is slower than a bucket's fastest by more than
# this factor (differences below it are within one run's spread).
SPLIT_WITHIN = 1.03

_ROW_KEYS = ("op", "dtype", "cache", "heads", "batch", "context", "us")


def bounds(kind: str, op: str | None = None) -> tuple[int, ...]:
    """The bucket bounds of ``kind`` ("heads", "batch" or "context"; ``op``'s own context buckets where it has
    some, :data:`FINE_CONTEXT`)."""
    return FINE_CONTEXT.get(op, BUCKETS[kind]) if kind == "context" else BUCKETS[kind]


def bucket(kind: str, value: int, op: str | None = None) -> int:
    """The bound of ``value``'s ``kind`` bucket (see :func:`bounds`)."""
    edges = bounds(kind, op)
    return next((e for e in edges if value <= e), edges[-1])


def cache_format(cache_dtype: torch.dtype) -> str:
    """A cache dtype as a timing key: "fp8" for the uint8 rows, else the dtype's name."""
    return "fp8" if cache_dtype == torch.uint8 else str(cache_dtype).replace("torch.", "")


@dataclass(frozen=True)
class Row:
    """One shape class's timings: ``us`` maps backend name to microseconds per call."""

    op: str
    dtype: str
    cache: str
    heads: int
    batch: int
    context: int
    us: dict[str, float] = field(hash=False)
    shape: str = ""
    source: str = ""


@dataclass(frozen=True)
class Table:
    """A timing file: ``gpu`` and ``capability`` it was measured on, ``versions``, ``source`` (runs and
    commands), ``seeded`` (copied from BENCHMARKS.md rather than written by bench_backends.py), ``rows``."""

    gpu: str
    capability: tuple[int, int]
    rows: tuple[Row, ...]
    versions: dict[str, str] = field(default_factory=dict, hash=False)
    source: str = ""
    seeded: bool = False


def check(doc: dict) -> list[str]:
    """Every problem of a timing file's contents (a dict from JSON); empty when it is valid."""
    errors = []
    if doc.get("format") != FORMAT:
        errors.append(f"format must be {FORMAT}, got {doc.get('format')!r}")
    if not isinstance(doc.get("gpu"), str) or not doc.get("gpu"):
        errors.append("gpu must name the GPU the timings came from")
    cap = doc.get("capability")
    if not (isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
        errors.append(f"capability must be [major, minor], got {cap!r}")
    if not isinstance(doc.get("versions"), dict):
        errors.append("versions must map package names to versions")
    for i, row in enumerate(doc.get("rows", [])):
        missing = [k for k in _ROW_KEYS if k not in row]
        if missing:
            errors.append(f"row {i}: missing {missing}")
            continue
        for kind in ("heads", "batch", "context"):
            if row[kind] not in bounds(kind, row["op"]):
                errors.append(f"row {i}: {kind} {row[kind]!r} is not a bucket bound {list(bounds(kind, row['op']))}")
        us = row["us"]
        if not isinstance(us, dict) or not us or not all(isinstance(v, (int, float)) and v > 0 for v in us.values()):
            errors.append(f"row {i}: us must map backend names to positive microseconds, got {us!r}")
    if not isinstance(doc.get("rows"), list):
        errors.append("rows must be a list")
    return errors


def parse(doc: dict) -> Table:
    """A :class:`Table` from a timing file's contents; a ValueError listing every problem."""
    errors = check(doc)
    if errors:
        raise ValueError("invalid backend timing file: " + "; ".join(errors))
    rows = tuple(Row(**{k: r[k] for k in _ROW_KEYS}, shape=r.get("shape", ""), source=r.get("source", ""))
                 for r in doc["rows"])
    return Table(doc["gpu"], tuple(doc["capability"]), rows, dict(doc["versions"]), doc.get("source", ""),
                 bool(doc.get("seeded", False)))


def load(path: str | Path) -> Table:
    """Read and check one timing file."""
    return parse(json.loads(Path(path).read_text()))


_INSTALLED: list[tuple[Table, ...] | None] = [None]  # None: the shipped files, read on first use


def tables() -> tuple[Table, ...]:
    """The timing tables in use (the shipped files unless :func:`using` replaced them)."""
    if _INSTALLED[0] is None:
        _INSTALLED[0] = tuple(load(p) for p in sorted(FOLDER.glob("*.json")))
    return _INSTALLED[0]


@contextlib.contextmanager
def using(*replacement: Table) -> Iterator[None]:
    """Within the block, "auto" ranks by ``replacement`` only (none: static order everywhere)."""
    saved = _INSTALLED[0]
    _INSTALLED[0] = tuple(replacement)
    try:
        yield
    finally:
        _INSTALLED[0] = saved


def _time(row: Row, name: str, tiers: dict[str, tuple]) -> float | None:
    if name in row.us:
        return row.us[name]
    for rows, part in tiers.get(name, ()):
        if rows is None or row.batch <= rows:
            return row.us.get(part)
    return None


def _installed(capability: tuple[int, int] | None) -> Table | None:
    """The installed timing table of GPUs of ``capability`` (None: none, or no GPU)."""
    return next((t for t in tables() if capability is not None and t.capability == tuple(capability)), None)


def _class_rows(table: Table, op: str, *, dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int,
                batch: int | None, context: int | None, capacity: int | None = None) -> tuple[dict, list[Row]]:
    """The call's class key and ``table``'s rows in that class (``capacity``: only rows at contexts up to its
    bucket; the key then says "context <= bound")."""
    key = dict(op=op, dtype=str(dtype).replace("torch.", ""), cache=cache_format(cache_dtype),
               heads=bucket("heads", num_heads))
    if batch is not None:
        key["batch"] = bucket("batch", batch)
    if context is not None:
        key["context"] = bucket("context", context, op)
    rows = [r for r in table.rows if all(getattr(r, k) == v for k, v in key.items())]
    if capacity is not None and context is None:
        limit = bucket("context", capacity, op)
        rows = [r for r in rows if r.context <= limit]
        key["context <="] = limit
    return key, rows


def _capacity_rows(table: Table, key: dict, capacity: int | None) -> dict[int, Row]:
    """The rows of ``key``'s op, dtype, cache and heads at the capacity's context bucket, by batch bound."""
    if capacity is None:
        return {}
    at = bucket("context", capacity, key["op"])
    base = {k: key[k] for k in ("op", "dtype", "cache", "heads")}
    return {r.batch: r for r in table.rows if r.context == at and all(getattr(r, k) == v for k, v in base.items())}


def _totals(rows: list[Row], names: list[str], tiers: dict[str, tuple], at_capacity: frozenset[str] = frozenset(),
            capacity_rows: dict[int, Row] | None = None) -> dict[str, float]:
    """Each of ``names`` timed in every one of ``rows``: its summed microseconds (composites as their parts; a name
    of ``at_capacity`` at its time in ``capacity_rows``' row of the same batch)."""
    totals = {}
    for n in names:
        if n in at_capacity:
            times = [_time(capacity_rows[r.batch], n, tiers) if r.batch in (capacity_rows or {}) else None
                     for r in rows]
        else:
            times = [_time(r, n, tiers) for r in rows]
        if rows and None not in times:
            totals[n] = sum(times)
    return totals


def rank(op: str, names: list[str], *, capability: tuple[int, int] | None, dtype: torch.dtype,
         cache_dtype: torch.dtype, num_heads: int | None, batch: int | None = None, context: int | None = None,
         capacity: int | None = None, tiers: dict[str, tuple] | None = None, table: Table | None = None,
         at_capacity: frozenset[str] = frozenset()) -> tuple[list[str], str]:
    """``names`` (in static order) reordered fastest first for this call's class, and why.

    ``table``: the one to use (default: the installed table of ``capability``); ``capacity``, ``at_capacity``: see
    the module docstring.
    """
    table = table or _installed(capability)
    if table is None or num_heads is None:
        return list(names), "static order (no timings for this GPU)" if table is None else "static order"
    key, rows = _class_rows(table, op, dtype=dtype, cache_dtype=cache_dtype, num_heads=num_heads, batch=batch,
                            context=context, capacity=capacity)
    totals = _totals(rows, names, tiers or {}, at_capacity, _capacity_rows(table, key, capacity))
    where = ", ".join(f"{k} {v}" for k, v in key.items() if k != "op")
    if not totals:
        return list(names), f"static order (no {table.gpu} timings for {op} [{where}] cover these backends)"
    timed = sorted(totals, key=lambda n: (totals[n], names.index(n)))
    figures = ", ".join(f"{n} {totals[n]:.1f} us" for n in timed)
    seeded = " (seeded from BENCHMARKS.md)" if table.seeded else ""
    return timed + [n for n in names if n not in totals], \
        f"fastest in the {table.gpu} timings{seeded} for {op} [{where}] over {len(rows)} shape(s): {figures}"


def tiers_by_batch(op: str, names: list[str], *, capability: tuple[int, int] | None, dtype: torch.dtype,
                   cache_dtype: torch.dtype, num_heads: int | None, context: int | None = None,
                   capacity: int | None = None, tiers: dict[str, tuple] | None = None, table: Table | None = None,
                   prefer: str | None = None, within: float = SPLIT_WITHIN, counts: str = "batch",
                   at_capacity: frozenset[str] = frozenset()) -> tuple[tuple[tuple[int | None, str], ...], str]:
    """The fastest of ``names`` (static order breaks ties) in each batch bucket of the call's class, as a
    split ``((bound, name), ..., (None, name))``, and why; ``()`` when one backend serves every bucket or the
    table cannot tell (a bucket where none of ``names`` is timed). ``prefer`` (the class's overall winner)
    keeps a bucket where it is within ``within`` times the bucket's fastest: a split only where it pays. A
    composite (``tiers``) that runs one part over a whole bucket counts as that part; equal neighbours merge.
    ``counts``: "batch" buckets by the rows' batch bound (decode: query rows), "tokens" by batch bound times
    context bound (prefill: the call's tokens)."""
    table = table or _installed(capability)
    if table is None or num_heads is None:
        return (), "no timings"
    key, rows = _class_rows(table, op, dtype=dtype, cache_dtype=cache_dtype, num_heads=num_heads, batch=None,
                            context=context, capacity=capacity)
    by_capacity = _capacity_rows(table, key, capacity)
    tiers = tiers or {}
    size = (lambda r: r.batch) if counts == "batch" else (lambda r: r.batch * r.context)
    winners: list[tuple[int, str, float]] = []
    for bound in sorted({size(r) for r in rows}):
        totals = _totals([r for r in rows if size(r) == bound], names, tiers, at_capacity, by_capacity)
        if not totals:
            return (), f"no timings of {names} at {counts} {bound}"
        best = min(totals, key=lambda n: (totals[n], names.index(n)))
        if prefer in totals and totals[prefer] <= within * totals[best]:
            best = prefer
        winners.append((bound, best, totals[best]))
    if len({name for _, name, _ in winners}) < 2:
        return (), "one backend wins every batch"
    merged: list[tuple[int | None, str]] = []
    low = 0
    for i, (bound, name, us) in enumerate(winners):
        inner = tiers.get(name, ())
        first, last = (next((n for b, n in inner if b is None or at <= b), None) for at in (low + 1, bound))
        if inner and first == last and first in names:
            name = first  # the composite runs one part over this whole bucket
            winners[i] = (bound, name, us)
        low = bound
        if merged and merged[-1][1] == name:
            merged[-1] = (bound, name)
            continue
        merged.append((bound, name))
    if len(merged) < 2:
        return (), "one backend wins every batch"
    merged[-1] = (None, merged[-1][1])
    if prefer is not None and tuple(merged) == tuple(tiers.get(prefer, ())):
        return (), f"{prefer} already splits this way"
    figures = ", ".join(f"{counts} <= {b}: {n} {us:.1f} us" for b, n, us in winners)
    return tuple(merged), f"fastest per batch in the {table.gpu} timings for {op}: {figures}"
