"""The driver-side aggregation of worker reports (pure: no Ray)."""

from __future__ import annotations

import pytest

from raytrain_events.ray.reports.aggregate import ReportAggregator, TimestampMismatchError, reduce_metrics


def report(rank, samples, tokens, ts, start=None, loss=(0.0, 0), metrics=None, final=False):
    return {
        "rank": rank,
        "start": start,
        "local_samples": samples,
        "local_tokens": tokens,
        "timestamp": dict(zip(("epoch", "batch", "sample", "token"), ts)),
        "train_loss_sum": loss[0],
        "train_loss_count": loss[1],
        "metrics": metrics or {},
        "final": final,
    }


ZERO = {"epoch": 0, "batch": 0, "sample": 0, "token": 0}


def test_sums_rank_local_counts_into_global_timestamp():
    agg = ReportAggregator()
    entry = agg.add(
        [report(0, 64, 100, (0, 4, 128, 350), start=ZERO), report(1, 64, 250, (0, 4, 128, 350), start=ZERO)]
    )
    assert (entry["time/sample"], entry["time/token"], entry["time/batch"]) == (128, 350, 4)
    entry = agg.add([report(0, 32, 10, (1, 6, 192, 380)), report(1, 32, 20, (1, 6, 192, 380))])
    assert (entry["time/epoch"], entry["time/sample"], entry["time/token"]) == (1, 192, 380)
    assert len(agg.history) == 2


def test_mismatch_between_workers_and_driver_is_an_error():
    agg = ReportAggregator()
    with pytest.raises(TimestampMismatchError, match="Rank 1's global Timestamp.*sample: worker 120 vs driver 128"):
        agg.add([report(0, 64, 0, (0, 4, 128, 0), start=ZERO), report(1, 64, 0, (0, 4, 120, 0), start=ZERO)])


def test_restart_from_checkpoint_resets_counts_to_the_checkpoint():
    agg = ReportAggregator()
    agg.add([report(0, 64, 0, (0, 4, 128, 0), start=ZERO), report(1, 64, 0, (0, 4, 128, 0), start=ZERO)])
    agg.add([report(0, 64, 0, (0, 8, 256, 0)), report(1, 64, 0, (0, 8, 256, 0))])
    # Workers died after batch 8; the new group resumed from a checkpoint at batch 4.
    ckpt = {"epoch": 0, "batch": 4, "sample": 128, "token": 0}
    entry = agg.add([report(0, 64, 0, (0, 8, 256, 0), start=ckpt), report(1, 64, 0, (0, 8, 256, 0), start=ckpt)])
    assert entry["time/sample"] == 256 and entry["attempt"] == 2
    # Where the group resumed (and, when the workers sent it, when it started): the goodput report's restarts.
    assert entry["resumed_from_batch"] == 4 and "attempt_started_at" not in entry
    timed = [
        dict(r, started_at=t)
        for r, t in zip(
            [report(0, 64, 0, (0, 8, 256, 0), start=ckpt), report(1, 64, 0, (0, 8, 256, 0), start=ckpt)], (7.5, 7.0)
        )
    ]
    entry = ReportAggregator().add(timed)
    assert entry["attempt_started_at"] == 7.0 and entry["resumed_from_batch"] == 4
    later = agg.add([report(0, 64, 0, (0, 12, 384, 0)), report(1, 64, 0, (0, 12, 384, 0))])
    assert "resumed_from_batch" not in later


def test_reduce_metrics_weights_train_loss_by_batches_and_averages_others():
    out = reduce_metrics(
        [
            {"train_loss_sum": 3.0, "train_loss_count": 3, "metrics": {"metrics/eval/accuracy": 0.5}},
            {"train_loss_sum": 1.0, "train_loss_count": 1, "metrics": {"metrics/eval/accuracy": 0.5}},
        ]
    )
    assert out == {"train/loss": 1.0, "metrics/eval/accuracy": 0.5}
