"""Issue 28 item 3: an async save makes no collective on the training thread (spawned gloo ranks).

The ranks name the save's directory alike from a token agreed at set-up; every rank's RNG state
is gathered to rank 0 in the background save, on the checkpointer's own process group, and every
rank's RNG file holds that rank's state at the save.
"""

from __future__ import annotations

import pytest
import torch

from raytrain_events.checkpoint import list_checkpoints
from raytrain_events.checkpoint.format.reader import read_checkpoint_files
from tests.parallel.save_workloads import save_collectives
from tests.parallel.spawn import run_ranks


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_async_saves_make_no_collective_on_the_training_thread(tmp_path, parallelism):
    folder = str(tmp_path / "checkpoints")
    arm = "ddp" if parallelism == "ddp" else {"shard_modules": ["Block"]}
    results = run_ranks(2, save_collectives, arm, folder)
    for rank, got in enumerate(results):
        assert got["in_save"] == [], f"rank {rank}: collectives inside save() on the training thread"
        assert got["own_group"]
        gathers = got["background_gathers_on_own_group"]  # the RNG gathers (and DCP's planning, for FSDP)
        assert len(gathers) >= 2 and all(gathers), (rank, gathers)
    assert results[0]["urls"] == results[1]["urls"] and len(results[0]["urls"]) == 2  # named alike, no talk
    checkpoints = list_checkpoints(folder)
    assert [c.url for c in checkpoints] == results[0]["urls"] and [c.batch for c in checkpoints] == [3, 5]
    for i, info in enumerate(checkpoints):
        names = [f"rng-rank{r}.pt" for r in range(2)]
        files = read_checkpoint_files(info, files=names).files
        for rank in range(2):  # each rank's own state, captured at that save
            assert torch.equal(files[names[rank]]["now"]["torch"], results[rank]["rngs"][i]), (info.name, rank)
