"""What a finished digits run (``examples/train.py``, 2 epochs, 2 workers) must have written.

Shared by the example tests (the embedded-Ray run) and the launcher test's ``ray job submit`` of the
same job, which import it by path (tests/examples is on ``sys.path`` for both).
"""

from __future__ import annotations

import json
import os

TRAIN_ROWS, EPOCHS, WORKERS = 1500, 2, 2  # 1797 digits - 297 eval rows = 1500, divisible by 2 workers


def check_summary(summary_path, run_dir, files_at=None):
    """The summary.json of a finished 2-epoch, 2-worker digits run.

    ``files_at``: a copy of ``run_dir`` taken when the run finished, where its files are checked
    (the shared run's directory goes on being continued by the resume test).
    """
    files_at = files_at or run_dir
    with open(summary_path) as fh:
        summary = json.load(fh)
    # The global Timestamp counts every worker's samples: exact, not per-rank.
    assert summary["train_rows"] == TRAIN_ROWS
    assert summary["timestamp"]["sample"] == TRAIN_ROWS * EPOCHS
    assert summary["timestamp"]["epoch"] == EPOCHS
    assert summary["metrics"]["time/sample"] == TRAIN_ROWS * EPOCHS
    # It learned something: 10 classes, chance is 0.1.
    assert summary["metrics"]["metrics/eval/accuracy"] > 0.5
    assert [h["epoch"] for h in summary["eval_history"]] == [1, 2]
    assert summary["config"]["num_workers"] == WORKERS
    # Checkpoints: keep=2 -> the last two (epochs 1 and 2 with the default save_interval=1ep) are
    # kept, committed, on disk.
    checkpoints = summary["checkpoints"]
    assert summary["checkpoint_folder"] == os.path.join(run_dir, "checkpoints")
    assert 1 <= len(checkpoints) <= 2
    assert checkpoints[-1]["timestamp"]["sample"] == TRAIN_ROWS * EPOCHS
    for checkpoint in checkpoints:
        path = os.path.relpath(checkpoint["url"].removeprefix("file://"), run_dir)
        assert not path.startswith(".."), (checkpoint["url"], run_dir)
        assert os.path.exists(os.path.join(files_at, path, "manifest.json"))
    assert os.path.exists(os.path.join(files_at, "config.yaml"))
    return summary
