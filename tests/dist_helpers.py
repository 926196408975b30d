"""Run a function on N local processes (gloo, CPU) for the parallel tests, with a hard deadline.

``run_ranks(fn, world, *args)`` spawns ``world`` processes with the ``torchrun`` environment variables set
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), calls ``fn(rank, world, *args)`` in each and returns
the results in rank order. A rank that raises makes the call raise with its traceback; a rank still running
at the deadline prints its threads' Python stacks to stderr and is killed (this launcher's own children only),
and the call raises ``TimeoutError`` naming it and the other ranks' errors.
``fn`` must be importable by name (a module-level function of an importable module).

Calls reuse a pool of ``world`` worker processes kept for the session (spawning and importing torch,
transformers and mla_compile costs seconds a call): each call gets a reset Dynamo and the RNG state of a fresh
process. A pool's workers hold one default (gloo) process group for their life, made when the pool starts;
a call's ``init`` reuses it, and a subgroup a call makes (``parallel.init``'s, ``DPStepSync``'s) is kept, not
destroyed, until the worker exits: gloo groups destroyed in a long-lived process crashed it natively after
some cycles (torch's bug, reproduced without this repo's code: BENCHMARKS.md's CPU table; the cause was found
later, functional collectives left in flight on gloo, which ``parallel/layers.py`` no longer does eagerly, so
keeping the subgroups is now a precaution). A call that fails or
times out ends its pool (the next call starts a new one); a call whose worker dies of a signal (a native crash)
is run once more on a new pool, with a warning naming the signal, and fails if that run fails too.
``fresh=True`` (and any call with ``env`` or ``expect_dead``) spawns its own processes, for tests whose ranks
exit, hang or need another environment.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import socket
import time
import traceback
import warnings

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, results, env: dict, args: tuple, start) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # what a call past its deadline sends (_timed_out)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    import torch

    torch.set_num_threads(1)
    try:
        # every rank has imported everything: start together, so short rendezvous timeouts hold under load
        start.wait(timeout=300)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises)
        results.put((rank, False, traceback.format_exc()))
    finally:
        from mla_compile.parallel import destroy

        try:
            destroy()
        except Exception:  # noqa: BLE001  (a dead peer can fail the teardown; the result is already sent)
            pass


def _keep_subgroups(dist) -> None:
    """Make ``dist.destroy_process_group(group)`` a no-op for every group but the default one (called with none,
    it still ends them all): the group stays registered and alive until the process exits (see the module
    docstring). Code calling ``torch.distributed.destroy_process_group`` by that name sees the change."""
    destroy = dist.destroy_process_group

    def keep(group=None):
        if group is None or group is dist.group.WORLD:
            destroy(group)

    dist.destroy_process_group = keep


def _serve(rank: int, world: int, port: int, jobs, results) -> None:
    """A pool worker: join the pool's default process group (rendezvous at ``port``), then run ``(seq, fn,
    args)`` jobs until ``None``, each as a fresh process would but on that group, keeping the subgroups jobs
    make. A crash (SIGSEGV, glibc's abort) prints every thread's Python stack to stderr (``faulthandler``), and so
    does SIGUSR1 (what a call past its deadline sends before it kills the workers)."""
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import random

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mla_compile.parallel import destroy
    from mla_compile.parallel.groups import DEFAULT_TIMEOUT

    torch.set_num_threads(1)
    _keep_subgroups(dist)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=DEFAULT_TIMEOUT)
    torch_rng, py_rng = torch.get_rng_state(), random.getstate()
    while (job := jobs.get()) is not None:
        seq, fn, args = job
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        torch._dynamo.reset()
        counters.clear()
        try:
            results.put((seq, rank, True, fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001  (reported to the parent, which raises)
            results.put((seq, rank, False, traceback.format_exc()))
        finally:
            try:
                destroy()  # forgets the job's parallel state; its subgroups and the pool's default group stay
            except Exception:  # noqa: BLE001  (the result is already sent)
                pass
    dist.destroy_process_group()


def _timed_out(procs, got: dict, errors: dict, timeout: float) -> TimeoutError:
    """The error of a call past its deadline, after the live workers ``procs`` printed every thread's Python stack
    to stderr, one after the other: the ranks that neither returned (``got``) nor raised (``errors``), and the
    errors."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.5)
    return TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(got) - set(errors))} did not finish within "
                        f"{timeout} s (their Python stacks: the captured stderr); the other ranks' errors: "
                        f"{list(errors.values())}")


class _Pool:
    """``world`` pool workers (spawned) on one default process group, one job queue each and one result
    queue."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.jobs:
                q.put(None)
        for p in self.procs:
            if not kill:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}
_SEQ = itertools.count()


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


class _WorkerKilled(RuntimeError):
    """A pool worker died of a signal during a call (a native crash)."""


def _run_pooled(fn, world: int, args: tuple, timeout: float) -> list:
    """One call on the session's pool of ``world`` workers; raises :class:`_WorkerKilled` when a worker died of a
    signal meanwhile."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world] = _Pool(world)
    seq = next(_SEQ)
    for q in pool.jobs:
        q.put((seq, fn, args))
    deadline = time.monotonic() + timeout
    got: dict[int, object] = {}
    errors: dict[int, str] = {}
    ok_pool = False
    try:
        while len(got) + len(errors) < world:
            try:
                s, rank, ok, out = pool.results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if not pool.alive():
                    codes = {r: p.exitcode for r, p in enumerate(pool.procs)}
                    killed = any(c is not None and c < 0 for c in codes.values())
                    raise (_WorkerKilled if killed else RuntimeError)(
                        f"a pool worker exited (exit codes {codes}); ranks' errors before: {list(errors.values())}"
                    ) from None
                if time.monotonic() > deadline:
                    raise _timed_out(pool.procs, got, errors, timeout) from None
                continue
            if s != seq:
                continue
            if ok:
                got[rank] = out
            else:
                errors[rank] = f"rank {rank}:\n{out}"
        ok_pool = not errors
    finally:
        if not ok_pool:  # a rank may still sit in a collective: end this pool, the next call starts another
            _POOLS.pop(world, None)
            pool.close(kill=True)
    if errors:
        raise RuntimeError("\n".join(errors.values()))
    return [got[r] for r in range(world)]


def run_ranks(fn, world: int, *args, timeout: float = 120.0, env: dict | None = None,
              expect_dead: tuple[int, ...] = (), fresh: bool = False) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]`` from ``world`` processes; see the module
    docstring. Ranks in ``expect_dead`` may exit without a result (their entry is None). ``fresh``: spawn new
    processes for this call instead of the session's pool."""
    if not (fresh or env or expect_dead):
        try:
            return _run_pooled(fn, world, args, timeout)
        except _WorkerKilled as exc:  # once more on a new pool (see the module docstring)
            warnings.warn(f"run_ranks({fn.__name__}): {exc}; running it again on new workers", stacklevel=2)
            return _run_pooled(fn, world, args, timeout)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = ctx.Barrier(world)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, env or {}, args, start), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, object] = {}
    errors: dict[int, str] = {}
    try:
        while len(got) + len(errors) < world:
            if all(not p.is_alive() for p in procs) and results.empty():
                time.sleep(0.2)
                if results.empty():
                    break
            try:
                rank, ok, out = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise _timed_out(procs, got, errors, timeout) from None
                continue
            if ok:
                got[rank] = out
            else:
                errors[rank] = f"rank {rank}:\n{out}"
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors.values()))
    missing = set(range(world)) - set(got) - set(expect_dead)
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {sorted(missing)} exited without a result (exit codes {codes})")
    return [got.get(r) for r in range(world)]
