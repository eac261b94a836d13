"""S3 requests per save, commit and load, and bytes read per rank, at 2, 4 and 8 gloo ranks (issue 28 item 5).

Spawned gloo ranks (CPU) train 2 batches of `make_model(width)` (3 Blocks of width x width, AdamW)
and save once, asynchronously, to a local S3 server (moto, ``checkpoint_io.s3_server``); then the
same number of ranks autoresumes from it. Every rank counts the requests its s3fs sends (each
``_call_s3``, which every s3fs request, listing pages included, goes through) and the bytes its
GETs return (``ContentLength``), by phase:

* ``save``: a rank's own writes (DCP shards; nothing for DDP ranks), in the background save;
* ``commit``: ``Committer.commit`` on rank 0 (state.pt, every rank's RNG file, the manifest, the
  folder's index; retention and the run dir's marker);
* ``load``: building the autoresuming Trainer (rank 0 picks "latest" from the index and reads the
  manifest and ``.metadata``; every rank reads its RNG file, state.pt and its byte ranges).

Extrapolation to 512 ranks: each count is fitted as ``a + b * W`` over W = 2, 4, 8 (least squares;
the fit is printed, so a count that is not linear in W shows up as a bad fit), bytes per rank as
``a + b / W`` (a fixed checkpoint split W ways, plus what every rank reads whole).

Run: ``PYTHONPATH=$PWD python bench/checkpoint_scale.py --ranks [--width 256]``
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Tuple

_PHASE = {"now": "start"}
_COUNTS: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_BYTES: collections.Counter = collections.Counter()

FSDP = {"shard_modules": ["Block"]}


def _install() -> None:
    """Count this process's S3 requests by phase (rank processes only)."""
    import s3fs

    from raytrain_events.checkpoint.folder.committer import Committer

    real, commit = s3fs.S3FileSystem._call_s3, Committer.commit

    async def counting(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        phase = _PHASE["now"]
        _COUNTS[phase][method] += 1
        out = await real(self, method, *args, **kwargs)
        if method == "get_object":
            _BYTES[phase] += int(out.get("ContentLength", 0) or 0)
        return out

    def counted_commit(self: Any, *args: Any, **kwargs: Any) -> Any:
        _PHASE["now"] = "commit"
        try:
            return commit(self, *args, **kwargs)
        finally:
            _PHASE["now"] = "save"

    s3fs.S3FileSystem._call_s3 = counting
    Committer.commit = counted_commit  # type: ignore[method-assign]


def _trainer(rank: int, folder: str, options: dict, parallelism: Any, width: int, autoresume: bool) -> Any:
    import torch

    from raytrain_events import Trainer
    from raytrain_events.checkpoint import CheckpointConfig
    from tests.parallel.workloads import make_loader, make_model

    model = make_model(width=width)
    return Trainer(
        model=model,
        train_dataloader=make_loader(rank, n=16, width=width),
        max_duration="2ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=0.05),
        parallelism=parallelism,
        checkpoint=CheckpointConfig(
            save_folder=folder,
            save_interval="2ba",
            lock_run_dir=False,
            save_every_n_seconds=None,
            autoresume=autoresume,
            storage_options=dict(options),
        ),
    )


def _taken() -> Dict[str, Any]:
    return {"counts": {p: dict(c) for p, c in _COUNTS.items()}, "bytes": dict(_BYTES)}


def save_counts(rank: int, world_size: int, folder: str, options: dict, parallelism: Any, width: int) -> Dict[str, Any]:
    _install()
    trainer = _trainer(rank, folder, options, parallelism, width, False)
    _PHASE["now"] = "save"
    trainer.fit()
    trainer.close()  # waits for the background save
    return _taken()


def load_counts(rank: int, world_size: int, folder: str, options: dict, parallelism: Any, width: int) -> Dict[str, Any]:
    _install()
    _PHASE["now"] = "load"
    trainer = _trainer(rank, folder, options, parallelism, width, True)
    assert trainer._checkpointer.loaded is not None
    _PHASE["now"] = "after"
    trainer.close()
    return _taken()


def _n(result: Dict[str, Any], phase: str) -> int:
    return sum(result["counts"].get(phase, {}).values())


def _fit(ws: List[int], ys: List[float], inverse: bool = False) -> Tuple[float, float]:
    """Least squares ``y = a + b * x`` with x = W (or 1 / W)."""
    xs = [1 / w if inverse else float(w) for w in ws]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def measure(
    widths: Tuple[int, ...], width: int, arms: Tuple[str, ...] = ("fsdp", "ddp")
) -> Dict[str, Dict[int, Dict[str, float]]]:
    from bench.checkpoint_io import s3_server
    from raytrain_events.checkpoint import list_checkpoints
    from tests.parallel.spawn import run_ranks

    rows: Dict[str, Dict[int, Dict[str, float]]] = {}
    with s3_server() as (root, options):
        for arm in arms:
            parallelism = FSDP if arm == "fsdp" else "ddp"
            rows[arm] = {}
            for w in widths:
                folder = f"{root}/{arm}-w{w}/checkpoints"
                saved = run_ranks(w, save_counts, folder, options, parallelism, width)
                loaded = run_ranks(w, load_counts, folder, options, parallelism, width)
                info = list_checkpoints(folder, storage_options=options)[-1]
                read = [r["bytes"].get("load", 0) for r in loaded]
                rows[arm][w] = {
                    "save r0": _n(saved[0], "save"),
                    "save other": max(_n(r, "save") for r in saved[1:]),
                    "commit r0": _n(saved[0], "commit"),
                    "load r0": _n(loaded[0], "load"),
                    "load other": max(_n(r, "load") for r in loaded[1:]),
                    "read r0 KiB": read[0] / 1024,
                    "read other KiB": max(read[1:]) / 1024,
                    "read total / ckpt": sum(read) / sum(f.size for f in info.files),
                }
                print(f"{arm} W={w}: {rows[arm][w]}", flush=True)  # each row as measured (the run is long)
    return rows


def report(rows: Dict[str, Dict[int, Dict[str, float]]], big: int = 512) -> None:
    for arm, by_w in rows.items():
        ws = sorted(by_w)
        print(f"\n[{arm}] S3 requests per save/commit/load and bytes read at load, per rank (measured) and fitted")
        head = " ".join(f"{'W=' + str(w):>9}" for w in ws)
        print(f"    {'':<18} {head}   {'fit (W ranks)':<24} {'W=' + str(big):>10}")
        for key in by_w[ws[0]]:
            ys = [by_w[w][key] for w in ws]
            inverse = key.startswith("read") and "total" not in key
            a, b = _fit(ws, ys, inverse)
            formula = f"{a:.1f} {'+' if b >= 0 else '-'} {abs(b):.2f}{' / W' if inverse else ' * W'}"
            at = a + b / big if inverse else a + b * big
            cells = " ".join(f"{y:9.1f}" if isinstance(y, float) else f"{y:9d}" for y in ys)
            print(f"    {key:<18} {cells}   {formula:<24} {at:10.1f}")
