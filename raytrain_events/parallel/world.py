"""Which worker counts a parallelism can use: rules that need no torch.

Ray Data's dataset manager checks them when it splits the data for a worker group (an elastic
group may be resized to any size), in a process that has no other use for torch; so they live
apart from `config.py`.
"""

from __future__ import annotations


def check_tensor_parallel_world(world_size: int, tensor_parallel: int) -> None:
    """Refuse a world size ``tensor_parallel`` does not divide: its ranks cannot form whole tensor groups.
    Checked where the mesh is built, by `RayTrainer` for a fixed worker count, and at each Ray worker
    start (an elastic group may be resized to any size)."""
    tp = tensor_parallel
    if tp > 1 and world_size % tp:
        raise ValueError(
            f"FSDPConfig(tensor_parallel={tp}) needs a world size divisible by {tp}, got {world_size} ranks. Fix: "
            f"a fixed num_workers that is a multiple of {tp} (an elastic (min, max) group may take any size in "
            "between), or another tensor_parallel."
        )
