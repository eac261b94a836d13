"""RayTrainer against a real local Ray instance: 2 CPU workers with gloo DDP."""

from __future__ import annotations

import glob
import os
import sys
import time

import numpy as np
import pytest
import torch
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.models import ClassifierModel

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's helpers to workers

ROWS, DIM = 256, 8


def make_rows(n=ROWS, tokens=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    ntok = rng.integers(1, 10, size=n) if tokens is None else tokens
    return [{"x": x[i], "y": int(y[i]), "ntok": int(ntok[i])} for i in range(n)]


VAL_ROWS = make_rows(64, seed=2)


def make_model():
    torch.manual_seed(0)
    return ClassifierModel(
        torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), num_classes=2
    )


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.2)


def count_tokens(batch):
    return int(batch["ntok"].sum())


class DumpPerRank(Callback):
    """Saves each rank's final parameters, timestamp and per-batch losses to a shared folder."""

    def __init__(self, folder, pace_s=0.0, validation_started_by=None):
        self.folder = folder
        self.pace_s = pace_s
        self.validation_started_by = validation_started_by  # a global batch: no step ends after it before one starts
        self.losses = []
        self.batch_times = []  # (global batch, wall time at its end)

    def batch_end(self, state, logger):
        self.losses.append((state.timestamp.get_value("ba"), float(state.loss)))
        self.batch_times.append((state.timestamp.get_value("ba"), time.time()))
        if self.validation_started_by is not None and state.rank == 0:
            open(f"{self.folder}/step-ended-{state.timestamp.get_value('ba')}", "w").close()  # `MarkValidationStart`
        time.sleep(self.pace_s)  # a step long enough that validations start while training goes on
        if state.timestamp.get_value("ba") == self.validation_started_by:
            # On a loaded machine Ray may start the first validation task only after training ended, and the
            # overlap below could not be seen: wait (60 s at most) until one has begun (`MarkValidationStart`).
            deadline = time.time() + 60
            while not glob.glob(f"{self.folder}/validation-started-*") and time.time() < deadline:
                time.sleep(0.1)

    def fit_end(self, state, logger):
        torch.save(
            {
                "params": state.model.state_dict(),
                "timestamp": state.timestamp.state_dict(),
                "losses": self.losses,
                "batch_times": self.batch_times,
            },
            f"{self.folder}/rank{state.rank}.pt",
        )


class FailValidationAt(Callback):
    """On the validating Trainer: an evaluator that raises on the checkpoint of global batch ``batch``."""

    def __init__(self, batch):
        self.batch = batch

    def eval_start(self, state, logger):
        if state.timestamp.get_value("ba") == self.batch:
            raise RuntimeError(f"validation fails on purpose at batch {self.batch}")


class MarkValidationStart(Callback):
    """On the validating Trainer: a file in ``folder`` as its evaluation starts (what `DumpPerRank` waits for);
    then a validation of a checkpoint before global batch ``until`` holds its evaluation until training's rank 0
    has ended global batch ``until`` (60 s at most). Training waits at ``validation_started_by`` (< ``until``)
    until a validation has started, so the steps after it end inside a running validation, unless training
    waited for validations, the thing the test is there to catch (then these 60 s run out)."""

    def __init__(self, folder, until):
        self.folder = folder
        self.until = until

    def eval_start(self, state, logger):
        batch = state.timestamp.get_value("ba")
        open(f"{self.folder}/validation-started-{batch}", "w").close()
        deadline = time.time() + 60
        while batch < self.until and not os.path.exists(f"{self.folder}/step-ended-{self.until}"):
            if time.time() > deadline:
                break
            time.sleep(0.05)


def load_ranks(folder, world):
    return [torch.load(f"{folder}/rank{r}.pt", weights_only=True) for r in range(world)]


def _fit(tmp_path, ray_data, rows, *, workers, batch_size, duration, folder, eval_rows=None, val_rows=None, **kw):
    from raytrain_events import RayTrainer

    datasets = {"train": ray_data.from_items(rows)}
    if eval_rows is not None:
        datasets["eval"] = ray_data.from_items(eval_rows)
    if val_rows is not None:
        datasets["val"] = ray_data.from_items(val_rows)
    pace_s = kw.pop("pace_s", 0.0)
    started_by = kw.pop("validation_started_by", None)
    return RayTrainer(
        model=make_model,
        optimizers=make_sgd,
        datasets=datasets,
        max_duration=duration,
        batch_size=batch_size,
        num_workers=workers,
        get_num_tokens_in_batch=count_tokens,
        deterministic_split=True,
        callbacks=lambda: [DumpPerRank(str(folder), pace_s, started_by)],
        storage_path=str(tmp_path / "runs"),
        report_interval="4ba",
        **kw,
    ).fit()


# Rank 0's 16 rows of each global batch 1 token each, rank 1's 9: 160 global tokens per batch, but 16 on rank 0
# and 144 on rank 1. 2,500 tokens are passed during global batch 16, the last of epoch 2; a rank that counted its
# own tokens would stop at batch 18 (rank 1) or 157 (rank 0).
SKEWED_TOKENS = np.array(([1] * 16 + [9] * 16) * (ROWS // 32))
TOKEN_DURATION = "2500tok"


@pytest.fixture(scope="module")
def two_worker_run(ray_cluster, tmp_path_factory):
    import ray.data

    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.ray.checkpointing.validation import AsyncValidation

    tmp = tmp_path_factory.mktemp("two")
    rows, eval_rows = make_rows(tokens=SKEWED_TOKENS), make_rows(128, seed=1)
    # "val" is evaluated as Ray tasks on the checkpoints (failing on purpose at batch 8), "eval" in the loop.
    # The duration is in tokens (`TOKEN_DURATION`): 2 epochs' worth, passed during the last batch of epoch 2.
    result = _fit(
        tmp,
        ray.data,
        rows,
        workers=2,
        batch_size=16,
        duration=TOKEN_DURATION,
        folder=tmp,
        eval_rows=eval_rows,
        val_rows=VAL_ROWS,
        checkpoint=CheckpointConfig(save_interval="4ba"),
        validation=AsyncValidation(
            datasets=["val"],
            resources={"CPU": 1},
            callbacks=lambda: [MarkValidationStart(str(tmp), until=12), FailValidationAt(8)],
        ),
        pace_s=0.4,
        validation_started_by=10,
    )
    return result, rows, eval_rows, tmp


def test_global_timestamp_is_exact(two_worker_run):
    result, rows, _, tmp = two_worker_run
    total_tokens = sum(r["ntok"] for r in rows)
    assert result.timestamp.get_value("sp") == ROWS * 2
    assert result.timestamp.get_value("tok") == total_tokens * 2
    assert result.timestamp.get_value("ep") == 2
    assert result.timestamp.get_value("ba") == 2 * ROWS // 32
    for rank_state in load_ranks(tmp, 2):  # every worker holds the same global timestamp
        ts = rank_state["timestamp"]
        assert (ts["epoch"], ts["batch"], ts["sample"], ts["token"]) == (2, 16, ROWS * 2, total_tokens * 2)


def test_ddp_replicas_identical(two_worker_run):
    _, _, _, tmp = two_worker_run
    rank0, rank1 = load_ranks(tmp, 2)
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


def test_history_has_reduced_train_loss_and_global_eval_metrics(two_worker_run):
    result, _, eval_rows, tmp = two_worker_run
    ranks = load_ranks(tmp, 2)
    previous = 0
    checked = 0
    for entry in result.history:
        if "train/loss" not in entry:
            continue
        batch = entry["time/batch"]
        window = [loss for r in ranks for (b, loss) in r["losses"] if previous < b <= batch]
        assert entry["train/loss"] == pytest.approx(sum(window) / len(window), rel=1e-5)
        previous = batch
        checked += 1
    assert checked >= 4
    # The final eval accuracy covers all ranks' shards: recompute it on the driver over the whole set.
    model = make_model()
    model.load_state_dict(ranks[0]["params"])
    x = torch.tensor(np.stack([r["x"] for r in eval_rows]))
    y = torch.tensor([r["y"] for r in eval_rows])
    with torch.no_grad():
        accuracy = (model.module(x).argmax(-1) == y).float().mean().item()
    assert result.metrics["metrics/eval/accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert result.metrics["final"] is True


def accuracy_of(params, rows):
    model = make_model()
    model.load_state_dict(params)
    x = torch.tensor(np.stack([r["x"] for r in rows]))
    y = torch.tensor([r["y"] for r in rows])
    with torch.no_grad():
        return (model.module(x).argmax(-1) == y).float().mean().item()


def test_async_validation_runs_as_ray_tasks_while_training_goes_on(two_worker_run):
    """Issue 41 item 3: "val" is evaluated off the training ranks, on each checkpoint, as a Ray task."""
    result, _, _, tmp = two_worker_run
    trained = [e for e in result.history if "validation" not in e]
    saved = {e["checkpoint_path"].rstrip("/").rsplit("/", 1)[-1]: e for e in trained if e.get("checkpoint_path")}
    assert [e["time/batch"] for e in saved.values()] == [4, 8, 12, 16]
    assert not any(k.startswith("metrics/val/") for e in trained for k in e)  # the workers never evaluated it
    validations = {e["validated_checkpoint"]: e for e in result.validations}
    assert sorted(validations) == sorted(saved)  # one entry per checkpoint, none lost
    for name, entry in validations.items():
        # At the checkpoint's global Timestamp: curves line up with the training entries and in-loop evals.
        counters = {k: v for k, v in saved[name].items() if k.startswith("time/")}
        assert {k: v for k, v in entry.items() if k.startswith("time/")} == counters
        if entry["time/batch"] == 8:  # the failing evaluator: recorded, and the run went on
            assert entry["validation"] == "failed"
            assert "validation fails on purpose at batch 8" in entry["validation_error"]
            assert "metrics/val/accuracy" not in entry
        else:
            assert entry["validation"] == "async" and 0.0 <= entry["metrics/val/accuracy"] <= 1.0
    assert result.metrics["final"] is True and result.timestamp.get_value("ba") == 16
    # The same metrics code on the loaded checkpoint: the final checkpoint's accuracy over the whole val set.
    rank0 = load_ranks(tmp, 2)[0]
    final = next(e for e in validations.values() if e["time/batch"] == 16)
    assert final["metrics/val/accuracy"] == pytest.approx(accuracy_of(rank0["params"], VAL_ROWS), abs=1e-6)
    # Training never waited: steps kept ending while the validations ran. A loop that waited for a
    # validation would end no step inside that validation's run: every validation that ran wholly while
    # training went on and lasted more than two paced steps (0.4 s each) has a step end inside it, and
    # the validations begun by batch 10 held their evaluation until batch 12 ended (`MarkValidationStart`),
    # so at least one overlapped training by two steps; a loop that waited would not get there in 60 s.
    # (A warm validation takes ~0.2 s, shorter than one step, so it may fall between two step ends.)
    times = [t for _, t in rank0["batch_times"]]
    spans = [(e["wall_time_started"], e["wall_time"]) for e in validations.values()]
    inside = [sum(start <= t <= end for t in times) for start, end in spans]
    long_within = [n for (start, end), n in zip(spans, inside) if end < times[-1] and end - start > 2 * 0.4]
    assert all(n >= 1 for n in long_within) and max(inside) >= 2, (inside, spans, times)
    assert max(e["wall_time"] for e in validations.values()) > times[-1]  # the run's end waited, not training


def test_two_workers_match_one_worker_with_same_global_batch(two_worker_run, ray_cluster, tmp_path):
    import ray.data

    _, rows, _, tmp = two_worker_run
    # Global batch k is rows [32k, 32k + 32) of the one global order: rank r trains its r-th 16 of
    # them; one worker with batch 32 trains the same global batches.
    single = tmp_path / "single"
    single.mkdir()
    _fit(tmp_path, ray.data, rows, workers=1, batch_size=32, duration="2ep", folder=single)
    two = load_ranks(tmp, 2)[0]["params"]
    one = load_ranks(single, 1)[0]["params"]
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=1e-5, atol=1e-5)


def test_token_duration_stops_every_rank_at_same_batch(two_worker_run):
    """A token duration counts the global tokens: every rank stops at the same batch. The shared run's duration
    is in tokens (`TOKEN_DURATION`, over `SKEWED_TOKENS`: that was a fit of its own). (A sample duration is the
    killed-once run's: it stops at 420 samples, mid-epoch; an epoch duration is the 1-worker run's and the
    resume tests'.)"""
    result, rows, _, tmp = two_worker_run
    assert [r["ntok"] for r in rows] == SKEWED_TOKENS.tolist()
    batches = {r["timestamp"]["batch"] for r in load_ranks(tmp, 2)}
    assert batches == {16}  # 160 tokens per global batch: 2,500 is passed during the 16th
    assert result.timestamp.get_value("ba") == 16
    assert result.timestamp.get_value("tok") == 16 * 160


def exploding_model():
    raise RuntimeError("boom in the model factory")


def test_worker_error_reaches_driver(ray_cluster, tmp_path):
    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.ray.driver import RayTrainingError

    trainer = RayTrainer(
        model=exploding_model,
        optimizers=make_sgd,
        datasets={"train": ray.data.from_items(make_rows(64))},
        max_duration="1ep",
        batch_size=16,
        num_workers=1,  # one worker proves the path: a second would only raise the same error
        storage_path=str(tmp_path),
    )
    with pytest.raises(RayTrainingError, match="boom in the model factory"):
        trainer.fit()


class KillOnce(Callback):
    """Kills rank 1's worker process mid-epoch, once per test (a marker file remembers)."""

    def __init__(self, marker, at_batch):
        self.marker, self.at_batch = marker, at_batch

    def batch_end(self, state, logger):
        import os

        if state.rank == 1 and state.step == self.at_batch and not os.path.exists(self.marker):
            import time

            open(self.marker, "w").close()
            # Ray's controller collects reports by polling (every 0.25 s in tests: conftest.py); give it
            # a few polls to register the checkpoints already reported, as it would have in a long run.
            # (The restart resumes from the run directory's newest committed checkpoint either way.)
            time.sleep(1.5)
            os.kill(os.getpid(), 9)


class CountReads:
    """A ``map_batches`` step that appends each batch's row count to ``path`` (one line each, from whichever
    process runs the dataset's pipeline): how many times a dataset was read."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, batch):
        with open(self.path, "a") as fh:
            fh.write(f"{len(batch['y'])}\n")
        return batch


def test_algorithms_and_callbacks_compose_in_a_two_worker_run_killed_once(ray_cluster, tmp_path):
    """Issue 7's integration check: a set of algorithms by name plus monitors, under DDP; and the
    same run's rank 1 SIGKILLed mid-epoch once: Ray restarts the group from the newest checkpoint
    and the run ends with the exact count (the killed run used to be a fit of its own).

    Its duration is in samples, 420 of 32 per global batch: every rank stops at batch 14, in the
    middle of epoch 2, and not at the epoch's end (the sample-duration fit of
    ``test_sample_and_token_durations_stop_every_rank_at_same_batch`` was folded in here)."""
    import os

    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.callbacks import LRMonitor, SpeedMonitor
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.report.goodput import goodput, read_events, read_failures

    marker = str(tmp_path / "killed")
    eval_reads = str(tmp_path / "eval_reads")
    rows = make_rows()
    result = RayTrainer(
        model=make_model,
        optimizers=make_sgd,
        datasets={
            "train": ray.data.from_items(rows),
            "eval": ray.data.from_items(make_rows(64, seed=3)).map_batches(
                CountReads(eval_reads), batch_format="numpy"
            ),
        },
        max_duration="420sp",  # 13.1 global batches: stops after the 14th (epoch 2's 6th)
        eval_interval="7ba",  # so the last batch, mid-epoch, is evaluated too
        batch_size=16,
        num_workers=2,
        deterministic_split=True,
        get_num_tokens_in_batch=count_tokens,
        storage_path=str(tmp_path / "runs"),
        run_name="failover",
        checkpoint=CheckpointConfig(save_interval="4ba"),
        max_failures=1,
        algorithms=[
            "label_smoothing",
            {"name": "mixup", "alpha": 0.2},
            {"name": "gradient_clipping", "clipping_type": "norm", "clipping_threshold": 1.0},
            {"name": "ema", "half_life": "4ba"},
        ],
        callbacks=lambda: [
            SpeedMonitor(window_size=2),
            LRMonitor(),
            DumpPerRank(str(tmp_path)),
            KillOnce(marker, at_batch=10),
        ],
        report_interval="4ba",
    ).fit()
    assert os.path.exists(marker), "the worker was never killed"
    # Global batch k of an epoch is rows [32k, 32k + 32) of the one global order: epoch 1 whole, then
    # 6 batches of epoch 2, counted exactly through the restart.
    assert result.timestamp.get_value("sp") == 14 * 32
    assert result.timestamp.get_value("ep") == 1
    assert result.timestamp.get_value("tok") == sum(r["ntok"] for r in rows) + sum(r["ntok"] for r in rows[: 6 * 32])
    assert max(e["attempt"] for e in result.history) == 2
    resumed = [e for e in result.history if e["attempt"] == 2]
    assert resumed[0]["time/batch"] > 4, "the restarted group did not resume from a checkpoint"
    assert [c.batch for c in result.checkpoints][-1] == 14
    assert result.ray_result.checkpoint is not None
    assert result.ray_result.checkpoint.path.endswith(result.checkpoints[-1].name)
    rank0, rank1 = load_ranks(tmp_path, 2)
    # The sample duration stopped every rank at the same batch.
    assert rank0["timestamp"]["batch"] == rank1["timestamp"]["batch"] == result.timestamp.get_value("ba") == 14
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
    assert result.metrics["throughput/samples_per_sec"] > 0
    assert result.metrics["lr-SGD/group0"] == pytest.approx(0.2)
    assert 0.0 <= result.metrics["metrics/eval/accuracy"] <= 1.0
    # The eval set (deterministic_split) was read once for both groups: on the driver (`TrainDataConfig.read_once`);
    # the restarted group split the blocks read there, it did not run the set's pipeline again.
    with open(eval_reads) as fh:
        assert sum(int(line) for line in fh) == 64
    # The controller recorded the failure (Ray Train's ``after_exception``), and the goodput report names its ranks'
    # errors (the killed rank's death, or rank 0's collective failing with it: which one Ray's poll saw first).
    run_dir = str(tmp_path / "runs" / "failover")
    (failure,) = read_failures(run_dir)
    assert failure["ranks"] and set(failure["ranks"]) <= {0, 1} and set(failure["died"]) <= {1}, failure
    (restart,) = goodput(result.history, *read_events(run_dir), read_failures(run_dir))["restarts"]
    assert restart["failures"] == 1 and restart["cause"].startswith("a worker or node was lost (rank "), restart
