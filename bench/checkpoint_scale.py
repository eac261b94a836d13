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

``--reshard`` (issue 28 item 1): bytes read per rank and in total when a checkpoint saved by N
spawned gloo ranks (FSDP2, AdamW, EMA; file://) autoresumes on M ranks, for 8 -> 6, 4 -> 8 and
8 -> 3, counted at the fsspec layer (``tests/parallel/io_count.py``). ``before`` runs the same
load with the previous read path put back in the ranks: every rank reads ``.metadata`` itself
(twice) and DCP's reader reads every overlapping saved item whole. Formulas, for dim-0 shards of
C bytes of tensors, g = gcd(N, M), meta(N) the ``.metadata`` size (linear in N):
  before: C * (N + M - g) / N + 2 * M * meta(N);  ours: C + (N + M - g) * K * 2 KiB + meta(N)
(K tensor items; 2 KiB: the head/tail probes of ``ranged_dcp.py``), extrapolated to 512 ranks.

``--ranks`` (``checkpoint_ranks.py``): S3 requests per save, commit and load and bytes read per
rank at 2, 4 and 8 gloo ranks (FSDP and DDP), fitted and extrapolated to 512 ranks.
``--blocking`` (``checkpoint_blocking.py``): the training thread's blocking time per async save
against a run without checkpointing and against the copy to host alone.

Run: ``PYTHONPATH=$PWD python bench/checkpoint_scale.py [--history 1 10 50] [--reshard [--width 512]]
[--ranks [--width 256]] [--blocking [--mb 64 --repeats 5]]``
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
from raytrain_events.checkpoint.folder.committer import Committer  # noqa: E402
from raytrain_events.checkpoint.folder.folder import CheckpointFolder  # noqa: E402
from raytrain_events.checkpoint.folder.index import CheckpointIndex  # noqa: E402
from raytrain_events.checkpoint.folder.store import _scan, latest_checkpoint  # noqa: E402
from raytrain_events.checkpoint.format.writer import CheckpointSave, new_checkpoint_url, write_checkpoint  # noqa: E402
from raytrain_events.storage import fs as sfs  # noqa: E402
from raytrain_events.storage.location import Location  # noqa: E402


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
            committer = Committer(CheckpointFolder(folder, opts), deadline_s=0)
            for b in (h, h + 0.5):  # the first commit also marks the run dir (once): count the second
                counter.take()
                where = Location.of(new_checkpoint_url(folder, timestamp={"batch": int(b)}), opts)
                committer.commit(CheckpointSave(where, {"batch": int(b)}, 1), _files(h), [])
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


def before_load(rank: int, world_size: int, folder: str, width: int) -> dict:
    """``wide_load`` with the read path of before issue 28 item 1 put back in this rank."""
    from raytrain_events._torch_compat import FsspecReader
    from raytrain_events.checkpoint.dcp import safe_dcp, sharded
    from tests.parallel.reshard_workloads import wide_load

    init = safe_dcp.SafeDCPReader.__init__

    def every_rank_reads(self, path, metadata=None, expected=None, **options):
        init(self, path, None, expected, **options)

    def own_metadata(self, info):
        return safe_dcp.SafeDCPReader(info.url, **self.options).read_metadata()

    safe_dcp.SafeDCPReader.__init__ = every_rank_reads  # DCP's load reads .metadata again
    safe_dcp.SafeDCPReader.read_data = FsspecReader.read_data  # whole saved items
    sharded.ShardedCheckpointIO.shared_metadata = own_metadata
    return wide_load(rank, world_size, folder, width)


def _chunks(url: str) -> int:
    from raytrain_events.checkpoint.dcp.safe_dcp import load_metadata_safely

    with open(os.path.join(url, ".metadata"), "rb") as f:
        metadata = load_metadata_safely(f, url)
    return sum(len(getattr(item, "chunks", ())) or 1 for item in metadata.state_dict_metadata.values())


def _dcp_read(counts: dict) -> int:
    return sum(n for name, n in counts["bytes"].items() if name.endswith(".distcp") or name == ".metadata")


def reshard(pairs: list, width: int, ranks: int = 512) -> None:
    import math
    import tempfile

    from raytrain_events.checkpoint import list_checkpoints
    from tests.parallel.reshard_workloads import wide_load, wide_save
    from tests.parallel.spawn import run_ranks

    print(f"reshard bytes (file://, width {width}; DCP files only: .distcp + .metadata)")
    print(f"{'N -> M':>8} | {'ckpt MiB':>8} {'.metadata KiB':>13} | {'per rank max (before/ours) MiB':>30} |")
    sizes = {}
    for n, m in pairs:
        with tempfile.TemporaryDirectory() as tmp:
            folder = os.path.join(tmp, "checkpoints")
            run_ranks(n, wide_save, folder, width)
            info = list_checkpoints(folder)[-1]
            meta = next(f.size for f in info.files if f.name == ".metadata")
            total = sum(f.size for f in info.files if f.name.endswith(".distcp")) + meta
            sizes[n] = (total, meta, _chunks(info.url))
            got = {}
            for arm, fn in (("before", before_load), ("ours", wide_load)):
                per_rank = [_dcp_read(r["counts"]) for r in run_ranks(m, fn, folder, width)]
                got[arm] = (max(per_rank), sum(per_rank))
        mib = 2**20
        print(
            f"{n:>3} -> {m:<2} | {total / mib:8.2f} {meta / 1024:13.1f} | "
            f"{got['before'][0] / mib:14.2f} / {got['ours'][0] / mib:13.2f} | total read "
            f"before {got['before'][1] / total:.2f}x, ours {got['ours'][1] / total:.2f}x of the checkpoint"
        )
    per_chunk = max(meta / chunks for _, meta, chunks in sizes.values())
    c0 = sizes[max(sizes)][0]
    print(f"\n.metadata: {per_chunk:.0f} B per saved chunk (measured). Extrapolated by the formulas in the docstring:")
    for label, c, k in ((f"this model, C = {c0 / 2**20:.1f} MiB, K = 16", c0, 16), (_BIG, 840e9, 2160)):
        print(f"  {label}")
        for n, m in ((512, 448), (256, 512), (64, 512), (512, 384)):
            g, meta = math.gcd(n, m), per_chunk * n * k
            before = c * (n + m - g) / n + 2 * m * meta
            ours = c + (n + m - g) * k * 2048 + meta
            print(
                f"    {n:>3} -> {m:<3}: before {before / c:6.2f}x, ours {ours / c:6.3f}x of the checkpoint "
                f"(.metadata {meta / 2**20:.1f} MiB, read {2 * m} times before, once now)"
            )


_BIG = "70B-class: C = 840 GB (fp32 params + 2 Adam moments), K = 2160 sharded tensor items"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--reshard", action="store_true", help="the N -> M reshard bytes instead")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ranks", action="store_true", help="request counts and bytes at 2, 4, 8 gloo ranks")
    parser.add_argument("--arms", nargs="+", default=["fsdp", "ddp"], help="--ranks: fsdp and/or ddp")
    parser.add_argument("--blocking", action="store_true", help="training-thread blocking time per async save")
    parser.add_argument("--mb", type=int, default=64, help="--blocking: MiB of parameters")
    parser.add_argument("--every", type=int, default=5, help="--blocking: batches between saves")
    parser.add_argument("--saves", type=int, default=4, help="--blocking: saves per run")
    parser.add_argument("--repeats", type=int, default=5, help="--blocking: runs per arm")
    args = parser.parse_args()
    if args.blocking:
        from bench.checkpoint_blocking import blocking

        blocking(args.mb, args.every, args.saves, args.repeats)
    elif args.ranks:
        from bench.checkpoint_ranks import measure, report

        report(measure((2, 4, 8), args.width, tuple(args.arms)))
    elif args.reshard:
        reshard([(8, 6), (4, 8), (8, 3)], args.width)
    else:
        run(args.history)


if __name__ == "__main__":
    main()
