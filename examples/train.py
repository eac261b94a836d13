"""Train a digits classifier on Ray Train workers: no download, a few CPUs, about a minute.

    python examples/train.py                                   # embedded local Ray, 2 CPU workers
    python examples/train.py num_workers=4 max_duration=3ep    # key=value overrides
    python examples/train.py --config my.yaml storage=s3://my-bucket/runs
    python examples/train.py run_name=digits-1 resume=true     # continue from the newest checkpoint
    python examples/train.py --help                            # every option and config key

scikit-learn's bundled 8x8 digits (1,797 images) are written as Parquet into the run
directory, read back with ray.data.read_parquet and split 1,500 train / 297 eval. An MLP
(or model=cnn) trains with SGD and a cosine schedule with warmup, checkpoints every epoch
into <storage>/<run_name>/checkpoints (keeping 2), shows a progress bar, and prints and
saves a summary (<storage>/<run_name>/summary.json).

This file is the whole job (config schema, data writer, models, job) and needs only the
installed package: ``ray submit cluster.yaml examples/train.py`` copies this one file to the
head node and runs it there, where it joins the cluster instead of starting its own Ray. The
defaults are the schema below (``examples/configs/digits.yaml`` spells them out; ``--config``
is optional) and the data ships with scikit-learn. ``raytrain-events train`` runs the same job
(its default entry point is ``examples/train.py:train_digits``).
"""

from __future__ import annotations

import functools
import io
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig

from raytrain_events.cli import TrainingFailed, UsageError, config_main, storage_step, to_plain
from raytrain_events.cli.summary import format_summary, run_summary, write_summary
from raytrain_events.storage.exp_dir import check_run_name, fresh_run_name

NUM_DIGITS = 1797  # rows in sklearn.datasets.load_digits


def _help(text: str, **extra: Any) -> Dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class CheckpointSection:
    enabled: bool = field(default=True, metadata=_help("Save checkpoints (into <storage>/<run_name>/checkpoints)."))
    save_interval: Optional[str] = field(
        default="1ep",
        metadata=_help(
            "Save whenever the global time crosses a multiple of this, like 1ep or 50ba.", time=True, dur=False
        ),
    )
    keep: Optional[int] = field(default=2, metadata=_help("How many checkpoints to keep (null keeps all)."))


@dataclass
class DigitsConfig:
    run_name: Optional[str] = field(
        default=None,
        metadata=_help(
            "Run directory name under storage; null picks digits-<date>-<time>-<6 hex>. Reuse a name with resume=true."
        ),
    )
    storage: str = field(
        default="./runs", metadata=_help("Where runs live: a local path, file://, s3://bucket/prefix, gs://, az://.")
    )
    storage_options: Dict[str, Any] = field(
        default_factory=dict,
        metadata=_help("fsspec options for storage, e.g. {client_kwargs: {endpoint_url: 'http://minio:9000'}}."),
    )
    address: Optional[str] = field(
        default=None,
        metadata=_help(
            "Ray cluster address (auto, ray://host:10001). null: the cluster this runs in (ray job submit, ray submit), else an embedded local Ray."
        ),
    )
    num_workers: int = field(default=2, metadata=_help("Ray Train workers (processes), one per GPU with use_gpu=true."))
    use_gpu: bool = field(default=False, metadata=_help("One GPU per worker (needs a cluster with GPU nodes)."))
    epochs: int = field(default=8, metadata=_help("Training length in epochs (used when max_duration is null)."))
    max_duration: Optional[str] = field(
        default=None,
        metadata=_help("Training length as a Time string (3ep, 200ba, 1e4sp); overrides epochs.", time=True, dur=False),
    )
    batch_size: int = field(
        default=64, metadata=_help("Rows per worker per batch (the global batch is batch_size * num_workers).")
    )
    lr: float = field(default=0.2, metadata=_help("Peak learning rate (SGD with momentum)."))
    momentum: float = field(default=0.9, metadata=_help("SGD momentum."))
    weight_decay: float = field(default=5e-4, metadata=_help("SGD weight decay."))
    warmup: str = field(
        default="0.1dur",
        metadata=_help(
            "Linear warmup before cosine decay, any Time string (0.1dur, 2ep, 20ba).", time=True, zero_ok=True
        ),
    )
    model: str = field(
        default="mlp", metadata=_help("mlp (64-hidden-hidden-10) or cnn (two 3x3 convs).", choices=["mlp", "cnn"])
    )
    hidden: int = field(default=128, metadata=_help("Hidden width of the MLP."))
    algorithms: List[Any] = field(
        default_factory=list,
        metadata=_help(
            "Algorithm specs by name: '[label_smoothing, {name: mixup, alpha: 0.2}]' (see raytrain_events.algorithms)."
        ),
    )
    eval_rows: int = field(
        default=297,
        metadata=_help(
            "Rows held out for eval; the rest (1500 by default) train. Keep the train rows divisible by num_workers."
        ),
    )
    seed: int = field(default=0, metadata=_help("Seed for the split, the initial weights and the shuffles."))
    resume: bool = field(default=False, metadata=_help("Continue run_name from its newest checkpoint (autoresume)."))
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    progress_bar: bool = field(
        default=True, metadata=_help("Show a progress bar of the global Timestamp on the driver.")
    )
    verbose: bool = field(
        default=False,
        metadata=_help("Show Ray's own log lines on the terminal too (by default they stay in Ray's log files)."),
    )
    report: bool = field(default=True, metadata=_help("Write report.html and plots into the run directory at the end."))
    report_interval: str = field(
        default="1ep",
        metadata=_help(
            "How often workers report metrics to the driver (a Time string; each report is a barrier, keep it >= 1s of training).",
            time=True,
            dur=False,
        ),
    )


# ---------------------------------------------------------------------------- the model
# Factories travel to the workers by reference: module-level functions with partial arguments.
def build_model(kind: str, hidden: int) -> Any:
    import torch

    from raytrain_events.models import ClassifierModel

    if kind == "cnn":
        module = torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 4 * 4, 10),
        )
    else:
        module = torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )
    return ClassifierModel(module, num_classes=10)


def build_optimizer(model: Any, lr: float, momentum: float, weight_decay: float) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def build_scheduler(optimizers: Any, warmup: str, max_duration: str, steps_per_epoch: int) -> Any:
    """Linear warmup then cosine decay, stepped every batch.

    Ray shards have no ``len()``, so the loop does not know the batches per epoch and would move an
    epoch-denominated schedule once per epoch (and round a '0.1dur' warmup of an 8-epoch run down
    to 0 epochs). The job knows it (rows per worker / batch size), so epochs and fractions of an
    epoch-long run become batches here.
    """
    from raytrain_events.core.time import Time, TimeUnit
    from raytrain_events.schedulers import CosineAnnealingWithWarmupScheduler

    duration, t_warmup = Time.from_timestring(max_duration), Time.from_timestring(warmup)
    schedule = CosineAnnealingWithWarmupScheduler(t_warmup=warmup)  # refuses a warmup past the run ('1.5dur')
    if duration.unit != TimeUnit.EPOCH:
        return schedule
    total = int(duration.value) * steps_per_epoch
    if t_warmup.unit == TimeUnit.DURATION:
        t_warmup = Time(int(t_warmup.value * total), TimeUnit.BATCH)
    elif t_warmup.unit == TimeUnit.EPOCH:
        t_warmup = Time(int(t_warmup.value * steps_per_epoch), TimeUnit.BATCH)
    if t_warmup.unit == TimeUnit.BATCH and t_warmup.value >= total:
        raise ValueError(
            f"warmup={warmup} lasts {t_warmup.value} batches, and the run has {total} ({max_duration}): the learning "
            "rate would never reach its peak. Fix: a shorter warmup, like warmup=0.1dur."
        )
    return CosineAnnealingWithWarmupScheduler(t_warmup=t_warmup, t_max=Time(total, TimeUnit.BATCH))


# ----------------------------------------------------------------------------- the data
def write_digits(data_url: str, *, eval_rows: int, seed: int, storage_options: Dict[str, Any]) -> Dict[str, Any]:
    """Write the digits as ``train.parquet`` and ``eval.parquet`` under ``data_url``; returns row counts and URLs."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    from raytrain_events.storage.fs import join, resolve, write_bytes_atomic

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    parts = {"eval": order[:eval_rows], "train": order[eval_rows:]}
    x = (x - x[parts["train"]].mean()) / x[parts["train"]].std()  # zero mean, unit variance over the train pixels
    fs, root = resolve(data_url, storage_options)
    fs.makedirs(root, exist_ok=True)
    urls = {}
    for name, idx in parts.items():
        table = pa.table(
            {"x": pa.FixedSizeListArray.from_arrays(pa.array(x[idx].reshape(-1)), 64), "y": pa.array(y[idx])}
        )
        sink = io.BytesIO()
        pq.write_table(table, sink)
        write_bytes_atomic(fs, join(root, f"{name}.parquet"), sink.getvalue())
        urls[name] = join(data_url, f"{name}.parquet")
    return {"train_rows": int(len(parts["train"])), "eval_rows": int(len(parts["eval"])), "urls": urls}


def read_parquet(url: str, storage_options: Dict[str, Any]) -> Any:
    """``ray.data.read_parquet`` on any fsspec URL (object stores through pyarrow's fsspec bridge)."""
    import ray.data

    if "://" not in url or url.startswith("file://"):
        return ray.data.read_parquet(url.removeprefix("file://"))
    import pyarrow.fs

    from raytrain_events.storage.fs import resolve

    fs, path = resolve(url, storage_options)
    return ray.data.read_parquet(path, filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))


# ------------------------------------------------------------------------------ the job
def run_url_of(cfg: DictConfig) -> str:
    """``<storage>/<run_name>`` with local paths made absolute (Ray workers need absolute paths)."""
    from raytrain_events.storage.fs import join

    storage = cfg.storage
    if storage.startswith("file://"):
        storage = storage[len("file://") :]
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    return join(storage, cfg.run_name)


def train_digits(cfg: DigitsConfig, *, echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """Train a classifier on scikit-learn's bundled 8x8 digits (no download) with RayTrainer.

    The data is written as Parquet into the run directory and read back with Ray Data, training
    runs on Ray Train workers (an embedded local Ray, or the cluster this runs in), checkpoints go
    to <storage>/<run_name>/checkpoints, and a summary is printed and saved as
    <storage>/<run_name>/summary.json. ``cfg`` is the validated config (a DictConfig of this schema).
    """
    started = time.time()
    if cfg.run_name is None:
        if cfg.resume:
            raise UsageError(
                "resume=true needs run_name=<the run to continue> (see `raytrain-events runs ls <storage>`)."
            )
        cfg.run_name = fresh_run_name("digits")  # digits-<date>-<time>-<6 hex>: two jobs never share one
    from raytrain_events.storage.fs import check_storage_url

    try:
        check_run_name(cfg.run_name)  # one folder name: the run never leaves its storage folder
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    storage_step(cfg.storage, lambda: check_storage_url(cfg.storage, "storage"))
    duration = cfg.max_duration or f"{cfg.epochs}ep"
    _check_numbers(cfg)
    options = to_plain(cfg.storage_options)
    run_url = run_url_of(cfg)
    checkpoint_url = run_url + "/checkpoints"
    _check_run_dir(cfg, run_url, checkpoint_url, options, echo)
    algorithms = _check_algorithms(to_plain(cfg)["algorithms"])
    data = storage_step(
        run_url,
        lambda: write_digits(run_url + "/data", eval_rows=cfg.eval_rows, seed=cfg.seed, storage_options=options),
    )
    if data["train_rows"] % cfg.num_workers:
        echo(
            f"note: {data['train_rows']} train rows do not split evenly over {cfg.num_workers} workers; "
            f"Ray drops {data['train_rows'] % cfg.num_workers} per epoch (set eval_rows to fix)."
        )

    trainer = _build_trainer(cfg, duration, algorithms, data, options)  # every option checked: Ray not started yet
    echo(
        f"Training {cfg.model} on digits ({data['train_rows']} train / {data['eval_rows']} eval rows) for {duration} "
        f"on {cfg.num_workers} worker(s){' with GPUs' if cfg.use_gpu else ''}; run directory {run_url}. "
        "Starting Ray and its workers first (tens of seconds on a fresh machine)."
    )
    _connect(cfg.address, cfg.num_workers, verbose=cfg.verbose)
    from raytrain_events.ray.driver import RayTrainingError
    from raytrain_events.storage.errors import LockError

    try:
        result = trainer.fit()
    except RayTrainingError as exc:
        raise TrainingFailed(str(exc)) from exc
    except LockError as exc:  # another run holds this run directory
        raise UsageError(str(exc)) from None
    except RuntimeError as exc:  # the cluster cannot run this config (use_gpu=true without GPUs)
        raise TrainingFailed(str(exc)) from None
    summary = run_summary(
        result,
        run_name=cfg.run_name,
        config=to_plain(cfg),
        seconds=time.time() - started,
        checkpoint_folder=checkpoint_url if cfg.checkpoint.enabled else None,
        storage_options=options,
        train_rows=data["train_rows"],
        eval_rows=data["eval_rows"],
        num_workers=cfg.num_workers,
    )
    summary["summary_url"] = storage_step(run_url, lambda: write_summary(run_url, summary, options))
    if cfg.report:  # report.html and PNGs: the run at a glance (raytrain-events report RUN_DIR writes the same)
        from raytrain_events.report import write_report

        summary["report_url"] = storage_step(run_url, lambda: write_report(run_url, options)["html"])
    echo(format_summary(summary))
    return summary


def _check_numbers(cfg: DictConfig) -> None:
    """Fail before anything starts (Ray takes a while) on values that cannot work."""
    checks = [
        (cfg.num_workers >= 1, f"num_workers={cfg.num_workers} must be >= 1"),
        (cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be >= 1"),
        (cfg.max_duration is not None or cfg.epochs >= 1, f"epochs={cfg.epochs} must be >= 1 (or set max_duration)"),
        (cfg.lr > 0, f"lr={cfg.lr} must be > 0"),
        (cfg.hidden >= 1, f"hidden={cfg.hidden} must be >= 1"),
        (
            1 <= cfg.eval_rows <= NUM_DIGITS - cfg.num_workers,
            f"eval_rows={cfg.eval_rows} must be between 1 and {NUM_DIGITS - cfg.num_workers} (the digits have {NUM_DIGITS} rows)",
        ),
        (
            cfg.checkpoint.keep is None or cfg.checkpoint.keep >= 1,
            f"checkpoint.keep={cfg.checkpoint.keep} must be >= 1 or null",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message + ".")


def _check_run_dir(
    cfg: DictConfig, run_url: str, checkpoint_url: str, options: Dict[str, Any], echo: Callable[[str], None]
) -> None:
    """Read the run directory before anything starts: the storage is reachable, a reused run_name
    is only continued on purpose, and a resumed run shows how its config changed.

    (`RayTrainer.fit` saves the run's config.yaml, with this job's config under ``config``.)
    """
    from raytrain_events.checkpoint import list_checkpoints
    from raytrain_events.storage.config_diff import format_config_diff
    from raytrain_events.storage.exp_dir import RunDir

    def previous_config() -> Any:
        try:
            saved = RunDir(run_url, options).load_config()
        except FileNotFoundError:
            return None
        return saved.get("config", saved)

    previous = storage_step(run_url, previous_config)
    existing = (
        storage_step(run_url, lambda: list_checkpoints(checkpoint_url, storage_options=options))
        if cfg.checkpoint.enabled
        else []
    )
    if existing and not cfg.resume:
        raise UsageError(
            f"Run {run_url!r} already has {len(existing)} checkpoint(s). Pass resume=true to continue it, "
            "or choose another run_name."
        )
    if cfg.resume:
        if previous is None and not existing:
            echo(f"resume=true but {run_url} has no checkpoints yet: starting from scratch.")
        elif previous is not None:  # RayTrainer prints how the config changed, once, before its progress bar
            echo(f"Resuming {run_url}" + ("." if format_config_diff(previous, cfg) else " with an unchanged config."))


def _check_algorithms(specs: List[Any]) -> List[Any]:
    """Build the algorithms once on the driver so a bad spec fails here, not on every worker."""
    if not specs:
        return []
    from raytrain_events.algorithms.registry import build_algorithms

    try:
        build_algorithms(specs)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"algorithms={specs!r}: {exc}") from None
    return specs


def _connect(address: Optional[str], num_workers: int, verbose: bool = False) -> None:
    """Join the cluster this runs in (or ``address``); else start a local Ray with CPUs to spare.

    A local Ray gets at least ``num_workers + 2`` logical CPUs: the workers hold one each for
    the whole run, and Ray Data needs free CPUs to read and split the Parquet files (with
    none left it waits forever).
    """
    import ray

    from raytrain_events.ray.cluster import _local_cluster_running, ensure_ray

    address = address or os.environ.get("RAY_ADDRESS")
    starts_local = not ray.is_initialized() and (
        address == "local" or (address is None and not _local_cluster_running())
    )
    extra = {"num_cpus": max(os.cpu_count() or 1, num_workers + 2)} if starts_local else {}
    try:
        ensure_ray(address, verbose=verbose, **extra)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(f"Cannot connect to Ray at {address or 'auto'}: {exc}") from None


def _build_trainer(
    cfg: DictConfig, duration: str, algorithms: List[Any], data: Dict[str, Any], options: Dict[str, Any]
) -> Any:
    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.ray.driver_checks import check_on_driver

    try:
        checkpoint = None
        if cfg.checkpoint.enabled:
            checkpoint = CheckpointConfig(
                save_interval=cfg.checkpoint.save_interval,
                keep=cfg.checkpoint.keep,
                autoresume=cfg.resume,
                storage_options=options,
            )
        trainer = RayTrainer(
            model=functools.partial(build_model, cfg.model, cfg.hidden),
            optimizers=functools.partial(
                build_optimizer, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
            ),
            schedulers=functools.partial(
                build_scheduler,
                warmup=cfg.warmup,
                max_duration=duration,
                steps_per_epoch=-(-(data["train_rows"] // cfg.num_workers) // cfg.batch_size),
            ),
            algorithms=algorithms,
            datasets=lambda: {  # read once Ray runs (RayTrainer.fit calls it), after every check
                "train": read_parquet(data["urls"]["train"], options),
                "eval": read_parquet(data["urls"]["eval"], options),
            },
            max_duration=duration,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            seed=cfg.seed,
            deterministic_split=True,
            storage_path=cfg.storage,
            storage_options=options,
            run_name=cfg.run_name,
            checkpoint=checkpoint,
            report_interval=cfg.report_interval,
            progress_bar=cfg.progress_bar,
            verbose=cfg.verbose,
            config=to_plain(cfg),
        )
        check_on_driver(trainer.spec)  # the factories on the meta device, algorithm names: before Ray starts
    except (ValueError, TypeError, OSError) as exc:
        raise UsageError(str(exc)) from None
    return trainer


if __name__ == "__main__":
    sys.exit(config_main(train_digits, sys.argv[1:], prog="train.py"))
