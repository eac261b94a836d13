"""Auto microbatching and per-evaluator options on a real 2-worker Ray run (gloo DDP on CPU).

One `RayTrainer.fit`: rank 1's model runs out of (simulated) device memory above 4 rows per
forward, rank 0's never does. Each rank records what it did (a callback saves it to ``tmp_path``),
and the tests check from that one run: both ranks retried at the same batch and ended at the same
doubled ``grad_accum``, the global Timestamp counted every sample once, the replicas are identical
and equal to a local run that started with the final value. The same run has two eval sets with
their own ``eval_options`` (a 1-batch subset every 3 batches, the whole set each epoch): each
rank ran exactly that schedule, and the driver's history holds ``metrics/<label>/<name>``.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from ray import cloudpickle as ray_cloudpickle
from torch.utils.data import DataLoader

from raytrain_events import Callback, Trainer
from raytrain_events.models import ClassifierModel

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's helpers to workers

ROWS, EVAL_ROWS, DIM, BATCH, LIMIT = 128, 64, 8, 16, 4
EPOCHS, BATCHES_PER_EPOCH = 2, ROWS // (2 * BATCH)  # 2 workers: a global batch is 32 rows


def make_rows(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x[:, 0] - x[:, 2] > 0).astype(np.int64)
    return [{"x": x[i], "y": int(y[i])} for i in range(n)]


class LimitedMemoryNet(torch.nn.Module):
    """Linear -> ReLU -> Linear; in training, a forward of more than ``limit`` rows raises a device OOM
    (as a GPU would, on CPU) after the first layer ran. Records the rows of every training forward."""

    def __init__(self, limit=None):
        super().__init__()
        self.body = torch.nn.Linear(DIM, 16)
        self.head = torch.nn.Linear(16, 2)
        self.limit = limit
        self.forward_rows = []

    def forward(self, x):
        rows = x.shape[0]
        if self.training:
            self.forward_rows.append(rows)
        hidden = torch.relu(self.body(x))
        if self.training and self.limit is not None and rows > self.limit:
            raise torch.OutOfMemoryError(f"simulated: {rows} rows > {self.limit}")
        return self.head(hidden)


def build_model(limit=None):
    torch.manual_seed(0)  # the same initial weights on every rank and in the local reference
    return ClassifierModel(LimitedMemoryNet(limit), num_classes=2)


def make_model():
    """The worker's model: only rank 1 has the memory limit."""
    import ray.train

    return build_model(LIMIT if ray.train.get_context().get_world_rank() == 1 else None)


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def collate(rows):
    """Rows as the worker's batches hold them: ``{"x": float32 [n, DIM], "y": int64 [n]}``."""
    return {"x": torch.as_tensor(np.stack([r["x"] for r in rows])), "y": torch.as_tensor([r["y"] for r in rows])}


class RecordRank(Callback):
    """Saves this rank's grad_accum, Timestamp, training forwards, evaluations and final weights."""

    def __init__(self, folder):
        self.folder = folder
        self.evals = []  # [step, eval batches] per evaluation

    def eval_start(self, state, logger):
        self.evals.append([state.step, 0])

    def eval_batch_start(self, state, logger):
        self.evals[-1][1] += 1

    def fit_end(self, state, logger):
        record = {
            "grad_accum": state.grad_accum,
            "timestamp": state.timestamp.state_dict(),
            "forward_rows": list(state.model.module.forward_rows),
            "evals": self.evals,
            "params": state.model.state_dict(),
        }
        torch.save(record, f"{self.folder}/rank{state.rank}.pt")


@pytest.fixture(scope="module")
def auto_run(ray_cluster, tmp_path_factory):
    import ray.data

    from raytrain_events import RayTrainer

    tmp = tmp_path_factory.mktemp("auto")
    rows = make_rows(ROWS, seed=0)
    result = RayTrainer(
        model=make_model,
        optimizers=make_sgd,
        datasets={
            "train": ray.data.from_items(rows),
            "quick": ray.data.from_items(make_rows(EVAL_ROWS, seed=1)),
            "full": ray.data.from_items(make_rows(EVAL_ROWS, seed=2)),
        },
        eval_options={"quick": {"eval_interval": "3ba", "subset_num_batches": 1}},  # full: the run's 1ep
        grad_accum="auto",
        max_duration=f"{EPOCHS}ep",
        batch_size=BATCH,
        num_workers=2,
        deterministic_split=True,  # rank r trains the r-th 16 rows of each global batch of 32
        callbacks=lambda: [RecordRank(str(tmp))],
        storage_path=str(tmp / "runs"),
        report_interval="4ba",
    ).fit()
    ranks = [torch.load(f"{tmp}/rank{r}.pt", weights_only=True) for r in range(2)]
    return result, rows, ranks


def test_both_ranks_retry_at_the_same_batch_and_end_at_the_same_value(auto_run):
    result, _, (rank0, rank1) = auto_run
    assert rank0["grad_accum"] == rank1["grad_accum"] == 4
    # Rank 1: 16 rows fail, 8 rows fail, then 4 x 4. Rank 0 never ran out, yet retried with rank 1:
    # its 16 and 2 x 8 went through locally and were dropped; then 4 x 4 like rank 1.
    assert rank1["forward_rows"][:6] == [16, 8, 4, 4, 4, 4]
    assert rank0["forward_rows"][:7] == [16, 8, 8, 4, 4, 4, 4]
    steps = EPOCHS * BATCHES_PER_EPOCH
    assert rank0["forward_rows"][3:] == rank1["forward_rows"][2:] == [4] * (4 * steps)
    assert result.metrics["trainer/grad_accum"] == 4  # logged on the retry, reduced on the driver


def test_timestamp_counts_each_sample_once(auto_run):
    result, _, ranks = auto_run
    assert result.timestamp.get_value("sp") == EPOCHS * ROWS
    assert result.timestamp.get_value("ba") == EPOCHS * BATCHES_PER_EPOCH
    assert result.timestamp.get_value("ep") == EPOCHS
    for rank in ranks:
        ts = rank["timestamp"]
        assert (ts["epoch"], ts["batch"], ts["sample"]) == (EPOCHS, EPOCHS * BATCHES_PER_EPOCH, EPOCHS * ROWS)


def test_replicas_identical_and_equal_to_starting_at_the_final_value(auto_run):
    _, rows, (rank0, rank1) = auto_run
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    # The same global batches in one process, starting at 8 microbatches of 4 rows (2 ranks x 4 x 4).
    model = build_model()
    loader = DataLoader(rows, batch_size=2 * BATCH, collate_fn=collate)
    Trainer(
        model=model, train_dataloader=loader, max_duration=f"{EPOCHS}ep", optimizers=make_sgd(model), grad_accum=8
    ).fit()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(rank0["params"][name], value, rtol=1e-5, atol=1e-6)


def test_evaluators_run_their_own_interval_and_subset_and_reach_the_driver(auto_run):
    result, _, ranks = auto_run
    # quick: 1 batch every 3 batches; full: its 2 batches per rank (32 rows) at each epoch end (4 batches).
    for rank in ranks:
        assert rank["evals"] == [[3, 1], [4, 2], [6, 1], [8, 2]]
    names = set().union(*result.history)
    for label in ("quick", "full"):
        assert {f"metrics/{label}/accuracy", f"metrics/{label}/cross_entropy"} <= names
    assert 0.0 <= result.metrics["metrics/full/accuracy"] <= 1.0
