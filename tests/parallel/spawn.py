"""Run a function on N gloo ranks in separate processes (CPU; started as `rank_processes` says), and collect each rank's result.

The function must be importable (module level). Each rank gets a process group on 127.0.0.1;
its return value comes back through a file (torch.save), so tensors are fine.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp
from rank_processes import rank_start_method


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()
    # The result is on disk: skip the interpreter's teardown, where now and then a spawned rank
    # aborted in torch's static destructors after its group was destroyed (see tests/trainer/gloo_ranks.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 420) -> List[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, _free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method=rank_start_method(),
        )
        try:
            import time

            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran over {timeout} s")
        except mp.ProcessRaisedException:
            pass  # the rank's traceback is in its result file, shown below
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(
                    f"rank {rank} of {fn.__name__} died without a result (exit codes {[p.exitcode for p in ctx.processes]})"
                )
            got = torch.load(path, weights_only=False)
            if "error" in got:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{got['error']}")
            results.append(got["ok"])
        return results
