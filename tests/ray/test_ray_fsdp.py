"""RayTrainer(parallelism="fsdp"): 2 CPU workers shard the model; a killed worker resumes exactly."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.models import ClassifierModel

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's helpers to workers

ROWS, DIM = 256, 8


def make_rows(n=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return [{"x": x[i], "y": int(y[i])} for i in range(n)]


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


def make_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), Block(16), Block(16), torch.nn.Linear(16, 2))
    return ClassifierModel(net, num_classes=2)


def make_adam(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01)


class DumpFullState(Callback):
    """At the end, every rank writes the full (gathered) model and its timestamp."""

    def __init__(self, folder):
        self.folder = folder

    def fit_end(self, state, logger):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True))
        sharded = any(type(p).__name__ == "DTensor" for p in state.model.parameters())
        torch.save(
            {"params": full, "timestamp": state.timestamp.state_dict(), "sharded": sharded},
            f"{self.folder}/rank{state.rank}.pt",
        )


class KillOnce(Callback):
    """Kills rank 1's worker process once, mid-epoch (a marker file remembers)."""

    def __init__(self, marker, at_batch):
        self.marker, self.at_batch = marker, at_batch

    def batch_end(self, state, logger):
        if state.rank == 1 and state.step == self.at_batch and not os.path.exists(self.marker):
            import time

            open(self.marker, "w").close()
            time.sleep(1.5)  # a few controller polls (0.25 s in tests): it registers the checkpoints reported
            os.kill(os.getpid(), 9)


def _run(tmp_path, name, callbacks):
    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.parallel import FSDPConfig

    return RayTrainer(
        model=make_model,
        optimizers=make_adam,
        datasets={"train": ray.data.from_items(make_rows())},
        max_duration="2ep",
        batch_size=16,
        num_workers=2,
        deterministic_split=True,
        parallelism=FSDPConfig(shard_modules=["Block"]),
        storage_path=str(tmp_path / "runs"),
        run_name=name,
        checkpoint=CheckpointConfig(save_interval="4ba"),
        max_failures=1,
        report_interval="4ba",
        callbacks=callbacks,
    ).fit()


def test_fsdp_run_killed_worker_resumes_exactly(ray_cluster, tmp_path):
    from raytrain_events.checkpoint import list_checkpoints

    killed, clean = tmp_path / "killed", tmp_path / "clean"
    killed.mkdir()
    clean.mkdir()
    marker = str(tmp_path / "marker")
    result = _run(tmp_path, "fsdp-killed", lambda: [KillOnce(marker, at_batch=14), DumpFullState(str(killed))])
    assert os.path.exists(marker), "the worker was never killed"
    assert result.timestamp.get_value("sp") == ROWS * 2
    assert max(e["attempt"] for e in result.history) == 2
    resumed = [e for e in result.history if e["attempt"] == 2]
    assert resumed[0]["time/batch"] > 4, "the restarted group did not resume from a checkpoint"
    infos = list_checkpoints(str(tmp_path / "runs" / "fsdp-killed" / "checkpoints"))
    assert infos[-1].batch == 16 and infos[-1].metadata["layout"] == "dcp"

    _run(tmp_path, "fsdp-clean", lambda: [DumpFullState(str(clean))])
    for rank in (0, 1):
        got = torch.load(killed / f"rank{rank}.pt", weights_only=True)
        want = torch.load(clean / f"rank{rank}.pt", weights_only=True)
        assert got["sharded"]
        counters = {k: v for k, v in want["timestamp"].items() if not k.endswith("_wct")}  # wall clock differs
        assert {k: got["timestamp"][k] for k in counters} == counters
        for key, value in want["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=0, atol=1e-6, msg=key)
