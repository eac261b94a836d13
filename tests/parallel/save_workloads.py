"""Rank functions for the save-path tests (importable by spawned processes)."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import torch.distributed as tdist

from raytrain_events.checkpoint.run.checkpointer import Checkpointer
from raytrain_events.checkpoint.run.rng import capture_rng_state
from tests.parallel.workloads import checkpointed_trainer, snapshot

COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "reduce_scatter_tensor",
    "broadcast",
    "gather",
    "barrier",
)


def save_collectives(rank: int, world_size: int, parallelism: Any, folder: str) -> Dict[str, Any]:
    """Train 5 batches with async saves at 3 and 5, recording every torch.distributed collective:
    which thread made it, whether a `Checkpointer.save` was running on the training thread, and
    whether it used the checkpointer's own process group. Also each save's URL and RNG state."""
    main = threading.main_thread()
    flag = {"save": False}
    calls: List[Dict[str, Any]] = []
    rngs: List[Any] = []
    originals = {name: getattr(tdist, name) for name in COLLECTIVES}

    def wrap(name: str, fn: Any) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            on_main = threading.current_thread() is main
            calls.append(
                {"name": name, "main": on_main, "in_save": flag["save"] and on_main, "group": kwargs.get("group")}
            )
            return fn(*args, **kwargs)

        return inner

    real_save = Checkpointer.save

    def save(self: Checkpointer) -> Any:
        rngs.append(capture_rng_state()["torch"].clone())
        flag["save"] = True
        try:
            return real_save(self)
        finally:
            flag["save"] = False

    for name, fn in originals.items():
        setattr(tdist, name, wrap(name, fn))
    Checkpointer.save = save  # type: ignore[method-assign]
    try:
        trainer = checkpointed_trainer(rank, parallelism, folder)
        trainer.fit()
        trainer.close()
    finally:
        for name, fn in originals.items():
            setattr(tdist, name, fn)
        Checkpointer.save = real_save  # type: ignore[method-assign]
    own = trainer._checkpointer.channel.group
    out = snapshot(trainer)
    out["urls"] = [s.url for s in trainer._checkpointer.saved]
    out["rngs"] = rngs
    out["in_save"] = [c["name"] for c in calls if c["in_save"]]
    background = [c for c in calls if not c["main"]]
    out["background"] = [c["name"] for c in background]
    out["background_gathers_on_own_group"] = [c["group"] is own for c in background if c["name"] == "gather_object"]
    out["own_group"] = own is not None
    return out
