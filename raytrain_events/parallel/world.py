"""Which worker counts a parallelism can use: rules that need no torch.

Ray Data's dataset manager checks them when it splits the data for a worker group (an elastic
group may be resized to any size), in a process that has no other use for torch; so they live
apart from `config.py`.
"""

from __future__ import annotations


def check_tensor_parallel_world(world_size: int, tensor_parallel: int, context_parallel: int = 1) -> None:
    """Refuse a world size that ``context_parallel * tensor_parallel`` (the ranks that load the same rows)
    does not divide: its ranks cannot form whole groups. Checked where the mesh is built, by `RayTrainer`
    for a fixed worker count, and at each Ray worker start (an elastic group may be resized to any size)."""
    group = tensor_parallel * context_parallel
    if group > 1 and world_size % group:
        degrees = [
            (n, v) for n, v in (("context_parallel", context_parallel), ("tensor_parallel", tensor_parallel)) if v > 1
        ]
        given = ", ".join(f"{name}={value}" for name, value in degrees)
        raise ValueError(
            f"FSDPConfig({given}) needs a world size divisible by {group}, got {world_size} ranks. Fix: "
            f"a fixed num_workers that is a multiple of {group} (an elastic (min, max) group may take any size in "
            f"between), or another {' or '.join(name for name, _ in degrees)}."
        )
