"""Checkpoint request counts as history and ranks grow: commit, "latest" at start-up, retention.

Counts every S3 API request s3fs sends to a local S3 server (moto, in a child process; see
``checkpoint_io.py``) for a small packed checkpoint, with H checkpoints already in the folder:

* ``commit``: ours = ``Committer.commit`` (upload + manifest, index.json PUT, prune from the
  index). ``before`` = what a commit did before the index: the same upload, then
  ``prune_checkpoints``/the Ray cleanup's scan (one LIST + one ranged GET per checkpoint).
* ``latest at start-up``: ours = rank 0 loads the index (GET index.json, one LIST) and reads the
  newest manifest; the other ranks get the choice in a collective (no request). ``before`` = every
  rank listed and read every manifest twice (the Ray worker's check, then ``load_latest_valid``).

Per-request formulas (printed next to the measurement, extrapolated to W=512 ranks and H=1000):
  commit: before 1 PUT + 1 LIST + H GETs;  ours 2 PUTs (3 with keep: the deletion's own requests
  are O(files of the deleted checkpoint), not O(H)).
  latest: before 2 x W x (1 LIST + H GETs);  ours 1 GET + 1 LIST + 1 GET, once.

Not measured here (left open, see the README section): multi-rank gloo saves and ranged reshard
bytes; the training thread's blocking time per save is ``checkpoint_io.py``'s third measurement.

Run: ``PYTHONPATH=$PWD python bench/checkpoint_scale.py [--history 1 10 50]``
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.checkpoint_io import s3_server  # noqa: E402
from raytrain_events.checkpoint.committer import Committer  # noqa: E402
from raytrain_events.checkpoint.format import new_checkpoint_url, write_checkpoint  # noqa: E402
from raytrain_events.checkpoint.index import CheckpointIndex  # noqa: E402
from raytrain_events.checkpoint.store import _scan, latest_checkpoint  # noqa: E402
from raytrain_events.storage import fs as sfs  # noqa: E402


class Counter:
    def __init__(self, fs):
        self.fs, self.calls = fs, collections.Counter()
        real = fs._call_s3

        async def counting(method, *a, **k):
            self.calls[method] += 1
            return await real(method, *a, **k)

        fs._call_s3 = counting

    def take(self) -> dict:
        out, self.calls = dict(self.calls), collections.Counter()
        return out


def _files(batch: int) -> dict:
    return {"state.pt": {"w": torch.full((256,), float(batch))}, "rng-rank0.pt": {"seed": batch}}


def run(history: list, ranks: int = 512, big_h: int = 1000) -> None:
    with s3_server() as (root, opts):
        fs, _ = sfs.resolve(root, opts)
        counter = Counter(fs)
        print(f"{'H':>5} | {'commit ours':>12} {'commit before':>14} | {'latest ours':>12} {'latest before/rank':>18}")
        for h in history:
            folder = f"{root}/h{h}/checkpoints"
            for b in range(h):
                write_checkpoint(folder, files=_files(b), timestamp={"batch": b}, world_size=1, storage_options=opts)
            CheckpointIndex.load(folder, opts).save()  # what the run's commits kept up to date
            committer = Committer(folder, opts, keep=None, deadline_s=0)
            for b in (h, h + 0.5):  # the first commit also marks the run dir (once): count the second
                counter.take()
                url = new_checkpoint_url(folder, timestamp={"batch": int(b)})
                committer.commit(url, _files(h), [], timestamp={"batch": int(b)}, world_size=1, metadata={})
            ours = sum(counter.take().values())
            write_checkpoint(
                folder, files=_files(h + 1), timestamp={"batch": h + 1}, world_size=1, storage_options=opts
            )
            counter.take()
            _scan(folder, opts)  # what each commit did on top of its upload before the index
            before = 1 + sum(counter.take().values())
            latest_checkpoint(folder, storage_options=opts)
            latest_ours = sum(counter.take().values())
            _scan(folder, opts)
            latest_before = 2 * sum(counter.take().values())
            print(f"{h:>5} | {ours:>12} {before:>14} | {latest_ours:>12} {latest_before:>18}")
        print()
        print(f"extrapolated, W={ranks} ranks, H={big_h} checkpoints (formulas in the docstring):")
        print(f"  commit requests: before {1 + 1 + big_h}, ours 2  ({(2 + big_h) / 2:.0f}x fewer)")
        print(f"  start-up 'latest' requests, all ranks: before {2 * ranks * (1 + big_h)}, ours 3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, nargs="+", default=[1, 10, 50])
    args = parser.parse_args()
    run(args.history)


if __name__ == "__main__":
    main()
