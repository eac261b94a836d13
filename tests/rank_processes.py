"""How the tests start spawned gloo ranks: forked from a forkserver that has imported torch once.

A fresh interpreter per rank ("spawn") imports torch, ``torch._dynamo`` (the first optimizer or
``DDP`` asks for it) and the loop, ~3-5 s of CPU per rank on this 2-core machine, for every rank of
every spawn in the suite. The forkserver pays that once per test session; each rank is then a fork
of it, which has imported but run nothing (no torch op, no process group): the start a spawned
rank gets, less the imports. Only the forking thread is copied into a rank. A rank inherits the
environment of the moment the forkserver started (the test session's), not a variable a test sets
later: ranks get their settings through their arguments.
"""

from __future__ import annotations

import multiprocessing

# What every rank imports anyway; a module missing here (an optional extra) is skipped by the server.
# ``torchmetrics``: what every rank that evaluates imports at its first evaluation (most of tests/parallel's
# workloads, the online mixture ranks): ~2.2 CPU-s each here (its __init__ imports transformers, scipy.signal and
# matplotlib: Lightning-AI/torchmetrics#3457), paid once by the server instead; a rank that never evaluates only
# shares the pages. Last, `rank_heap`: keeps those imports out of every rank's garbage collections (gc.freeze).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.nn.parallel",
    "raytrain_events.trainer",
    "torchmetrics",
    "rank_heap",
]


def rank_start_method() -> str:
    """``"forkserver"`` with `PRELOAD` where the platform has it, else ``"spawn"``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first use)
    return "forkserver"
