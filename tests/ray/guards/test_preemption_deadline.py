"""SIGTERM to one Ray worker: every rank saves at the next batch boundary, commits, and stops cleanly.

Ray runs the train function off the worker's main thread, where Python allows no signal handler;
`PreemptionGuard` has the main thread install one (Ray's own would exit the process at once). The
run must end without an error (``max_failures=0``) at the batch after the signal, with that batch's
checkpoint committed and the notice-to-commit time recorded in ``<run>/preemptions/``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback
from raytrain_events.checkpoint import CheckpointConfig
from tests import resume_helpers as h

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ray_cloudpickle.register_pickle_by_value(h)
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SigtermOnce(Callback):
    """Sends SIGTERM to rank 1's own process at the end of global batch ``at``.

    The signal is process-directed, as a cloud's is: the kernel may hand it to a thread other than
    this one, whose C-level handler then writes the wakeup pipe when that thread next runs. On a
    loaded machine that can come after the next batch boundary, so the callback waits (here, not
    in the library) until the signal must have been delivered: "the next batch" is then batch
    ``at + 1`` on every run, not only on a quiet machine (CI once saw the notice one batch late).
    """

    def __init__(self, folder: str, at: int) -> None:
        self.folder, self.at = folder, at

    def batch_end(self, state, logger) -> None:
        if state.rank == 1 and int(state.timestamp.batch) == self.at:
            with open(os.path.join(self.folder, "sigterm"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)


@pytest.mark.timeout(900)
def test_sigterm_to_one_worker_commits_at_the_next_batch_and_stops_cleanly(ray_cluster, tmp_path):
    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import list_checkpoints

    folder = str(tmp_path / "parquet")
    h.write_parquet(folder)
    records = str(tmp_path / "records")
    os.makedirs(records)
    result = RayTrainer(
        model=h.make_model,
        optimizers=h.make_sgd,
        datasets={"train": ray.data.read_parquet(folder)},
        batch_size=999,
        global_batch_size=h.GLOBAL_BATCH,
        storage_path=str(tmp_path / "runs"),
        run_name="preempted",
        max_duration="1ep",
        num_workers=2,
        report_interval="5ba",
        checkpoint=CheckpointConfig(save_interval="100ba", save_final=False, save_every_n_seconds=None),
        callbacks=lambda: [h.RecordRows(records, 0.2), SigtermOnce(str(tmp_path), at=6)],
    ).fit()  # max_failures=0: a process that died would fail the run
    assert int(result.timestamp.batch) == 7  # stopped at the next batch boundary
    assert [c.batch for c in list_checkpoints(str(tmp_path / "runs" / "preempted" / "checkpoints"))] == [7]
    assert result.latest_checkpoint.batch == 7
    record = json.loads((tmp_path / "runs" / "preempted" / "preemptions" / "batch-7.json").read_text())
    assert record["cause"] == "SIGTERM" and record["rank"] == 1 and record["ranks"] == [1], record
    assert record["notice_batch"] == 6 and record["saved_batch"] == 7 and record["stopping"]
    assert 0 < record["notice_to_commit_s"] < 30, record
    # Every rank trained the same 7 batches; none trained past the stop.
    assert sorted({r["batch_in_epoch"] for r in h.read_records(records)}) == list(range(1, 8))
