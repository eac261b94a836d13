"""Small models, data, marker callbacks and a resumable sweep shared by the Tune tests.

Imported as a plain module by the tests and by the subprocess of the resume test; it registers
itself to be pickled by value, so Ray workers get these functions without importing this file.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import uuid
from typing import Any, Dict, List

import numpy as np
import torch
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.models import ClassifierModel

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS, DIM = 256, 8

SETS = [[], ["label_smoothing"], [{"name": "label_smoothing", "smoothing": 0.3}, "gradient_clipping"]]
RESUME_SETS = [SETS[0], SETS[2]]


def make_rows(n: int = ROWS, seed: int = 0) -> List[Dict[str, Any]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return [{"x": x[i], "y": int(y[i])} for i in range(n)]


def make_model(config):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return ClassifierModel(net, num_classes=2)


def make_sgd(model, config):
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.2))


def trial_tag(config) -> str:
    """A file-name-safe name for a trial's config (its algorithm set and lr)."""
    from raytrain_events.tune import algorithm_set_label

    label = algorithm_set_label(config.get("algorithms", []))
    tag = f"{label}-lr{config.get('lr', 'default')}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)


class Marker(Callback):
    """Rank 0 writes ``start-<tag>-<id>`` at fit start and ``end-<tag>-<id>`` at fit end."""

    def __init__(self, folder: str, tag: str) -> None:
        self.folder, self.tag = folder, tag
        self.run = uuid.uuid4().hex[:8]

    def _mark(self, state, what: str) -> None:
        if state.rank == 0:
            with open(os.path.join(self.folder, f"{what}-{self.tag}-{self.run}"), "w") as f:
                f.write(str(state.timestamp.get_value("sp")))

    def fit_start(self, state, logger) -> None:
        self._mark(state, "start")

    def fit_end(self, state, logger) -> None:
        self._mark(state, "end")


class LossDump(Callback):
    """Every rank saves its per-batch ``(global batch, loss)`` list at fit end."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.losses: List = []

    def batch_end(self, state, logger) -> None:
        self.losses.append((state.timestamp.get_value("ba"), float(state.loss)))

    def fit_end(self, state, logger) -> None:
        torch.save(self.losses, os.path.join(self.folder, f"losses-rank{state.rank}.pt"))


def _markers(folder: str, config) -> List[Callback]:
    return [Marker(folder, trial_tag(config))]


def marker_callbacks(folder: str):
    """A callbacks factory ``fn(config)`` (the trainer calls it on each worker with the trial config)."""
    return functools.partial(_markers, str(folder))


def markers(folder: str, what: str) -> Dict[str, int]:
    """How many runs of each tag wrote a ``what`` ("start"/"end") marker."""
    counts: Dict[str, int] = {}
    for name in os.listdir(folder):
        if name.startswith(what + "-"):
            tag = name[len(what) + 1 :].rsplit("-", 1)[0]
            counts[tag] = counts.get(tag, 0) + 1
    return counts


def datasets(config=None):
    """Built inside each trial (a datasets factory), so nothing large travels with the sweep."""
    import ray.data

    return {"train": ray.data.from_items(make_rows()), "eval": ray.data.from_items(make_rows(128, seed=1))}


def datasets_with_val(config=None):
    """`datasets` and a "val" set (the one the grid's async validation evaluates off the training ranks)."""
    import ray.data

    return {**datasets(config), "val": ray.data.from_items(make_rows(64, seed=2))}


def train_only(config=None):
    import ray.data

    return {"train": ray.data.from_items(make_rows())}


def resumable_sweep(storage: str, marker_folder: str, **kw):
    """Two algorithm sets, one trial at a time: the sweep the resume test interrupts."""
    from raytrain_events.tune import algorithm_sets_grid, sweep

    return sweep(
        trainer=dict(
            model=make_model,
            optimizers=make_sgd,
            datasets=train_only,
            max_duration="2ep",
            batch_size=32,
            num_workers=1,
            report_interval="4ba",
            callbacks=marker_callbacks(marker_folder),
        ),
        param_space={"algorithms": algorithm_sets_grid(RESUME_SETS), "lr": 0.2},
        metric="train/loss",
        mode="min",
        max_concurrent_trials=1,
        storage_path=storage,
        name="resumable",
        verbose=0,
        **kw,
    )


if __name__ == "__main__":  # the resume test's subprocess: python tune_helpers.py STORAGE MARKERS
    import ray

    # Its own local Ray (never a cluster that `ray start` may have left on this machine).
    from raytrain_events.ray.embedded import own_state_api

    kwargs = {"num_cpus": 2, "include_dashboard": False}
    with own_state_api(kwargs):  # Train's cleaner asks this instance's state API, not another's
        ray.init(**kwargs)
    resumable_sweep(sys.argv[1], sys.argv[2])


def wait_until(ready, stop: str) -> None:
    """Until ``ready()``: an event, with no wall-clock bound that a loaded machine could run out (pytest-timeout
    bounds the test). ``stop`` (a file the test writes when its sweep ends, however it ends) frees the waits of
    trials a failed or timed-out test leaves running on the session's Ray."""
    while not ready() and not os.path.exists(stop):
        time.sleep(0.2)
