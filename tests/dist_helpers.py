"""Run a function on N local processes (gloo, CPU) for the parallel tests, with a hard deadline.

``run_ranks(fn, world, *args)`` spawns ``world`` processes with the ``torchrun`` environment variables set
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), calls ``fn(rank, world, *args)`` in each and returns
the results in rank order. A rank that raises makes the call raise with its traceback; a rank still running
at the deadline is killed (this launcher's own children only) and the call raises ``TimeoutError``.
``fn`` must be importable by name (a module-level function of an importable module).
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, results, env: dict, args: tuple, start) -> None:
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


def run_ranks(fn, world: int, *args, timeout: float = 120.0, env: dict | None = None,
              expect_dead: tuple[int, ...] = ()) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]`` from ``world`` processes; see the module
    docstring. Ranks in ``expect_dead`` may exit without a result (their entry is None)."""
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
    errors: list[str] = []
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
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} did not finish within "
                                       f"{timeout} s") from None
                continue
            if ok:
                got[rank] = out
            else:
                errors.append(f"rank {rank}:\n{out}")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    missing = set(range(world)) - set(got) - set(expect_dead)
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {sorted(missing)} exited without a result (exit codes {codes})")
    return [got.get(r) for r in range(world)]
