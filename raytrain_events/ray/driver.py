"""`RayTrainer`: run the event-driven `Trainer` on every Ray Train worker, from the driver.

Example (a 2-worker CPU run)::

    import ray.data
    from raytrain_events import RayTrainer
    from raytrain_events.models import ClassifierModel

    result = RayTrainer(
        model=lambda: ClassifierModel(torch.nn.Linear(64, 10), num_classes=10),
        optimizers=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        datasets={"train": ray.data.from_items(rows), "eval": ray.data.from_items(test_rows)},
        max_duration="3ep",
        batch_size=32,
        num_workers=2,
    ).fit()
    print(result.timestamp, result.metrics)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from raytrain_events.core.time import Time, Timestamp, TimeUnit, ensure_time
from raytrain_events.ray.spec import RunSpec

__all__ = ["RayTrainer", "RayResult", "RayTrainingError"]


class RayTrainingError(RuntimeError):
    """A Ray Train run failed; the message carries the worker's error and traceback."""


@dataclass
class RayResult:
    """What a run produced: the global Timestamp, metrics, history and checkpoints."""

    timestamp: Timestamp
    metrics: Dict[str, Any]
    history: List[Dict[str, Any]]
    checkpoints: List[Any] = field(default_factory=list)
    run_url: Optional[str] = None
    ray_result: Any = None

    @property
    def best_checkpoint(self) -> Any:
        """The newest committed checkpoint (None if the run saved none)."""
        return self.checkpoints[-1] if self.checkpoints else None


class RayTrainer:
    """Train on Ray Train workers with the same event-driven loop as `Trainer`.

    ``model``, ``optimizers`` and ``schedulers`` are factories called on each worker:
    ``model(config) -> nn.Module``, ``optimizers(model, config)``, ``schedulers(optimizers, config)``
    (each may omit the trailing ``config``). ``algorithms`` and ``callbacks`` are lists of
    instances or algorithm specs (``"label_smoothing"``, ``{"name": "mixup", "alpha": 0.2}``),
    or factories. ``datasets`` maps names to Ray Datasets: ``"train"`` is required, every other
    name is an eval set. ``batch_size`` is per worker.
    """

    def __init__(
        self,
        *,
        model: Callable[..., Any],
        optimizers: Callable[..., Any],
        datasets: Mapping[str, Any],
        max_duration: Union[str, int, Time],
        batch_size: int = 64,
        schedulers: Optional[Callable[..., Any]] = None,
        algorithms: Union[Sequence[Any], Callable[..., Any]] = (),
        callbacks: Union[Sequence[Any], Callable[..., Any]] = (),
        eval_batch_size: Optional[int] = None,
        eval_interval: Any = "1ep",
        grad_accum: int = 1,
        precision: str = "fp32",
        seed: Optional[int] = 0,
        get_num_tokens_in_batch: Optional[Callable[[Any], int]] = None,
        collate_fn: Optional[Callable] = None,
        prefetch_batches: int = 1,
        shuffle_buffer_size: Optional[int] = None,
        columns: Optional[List[str]] = None,
        steps_per_epoch: Optional[int] = None,
        num_workers: Optional[int] = None,
        use_gpu: bool = False,
        resources_per_worker: Optional[Dict[str, float]] = None,
        scaling_config: Any = None,
        storage_path: Optional[str] = None,
        storage_options: Optional[Dict[str, Any]] = None,
        run_name: Optional[str] = None,
        checkpoint: Any = None,
        max_failures: int = 0,
        report_interval: Any = None,
        report_every_s: Optional[float] = 10.0,
        deterministic_split: bool = False,
        config: Optional[Dict[str, Any]] = None,
        ray_callbacks: Sequence[Any] = (),
        progress_bar: bool = False,
    ) -> None:
        duration = ensure_time(max_duration, TimeUnit.EPOCH)
        if duration.unit == TimeUnit.DURATION:
            raise ValueError(
                f"max_duration={duration.to_timestring()!r}: give it in 'ep', 'ba', 'sp' or 'tok', like '10ep'."
            )
        if duration.unit == TimeUnit.TOKEN and get_num_tokens_in_batch is None:
            raise ValueError(
                f"max_duration={duration.to_timestring()!r} is in tokens: pass get_num_tokens_in_batch=fn(batch) -> int."
            )
        if report_interval is not None:
            ensure_time(report_interval, TimeUnit.BATCH)
        if report_interval is None and report_every_s is None:
            raise ValueError("Pass report_interval (a Time, like '500ba') or report_every_s (seconds), or both.")
        if "train" not in datasets:
            raise ValueError(
                f"datasets has no 'train' entry (got {sorted(datasets)}); pass datasets={{'train': ds, ...}}."
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer (rows per worker per batch).")
        if checkpoint is not None and getattr(checkpoint, "save_folder", None):
            raise ValueError(
                "CheckpointConfig.save_folder cannot be set for a RayTrainer run: checkpoints live in the run "
                "directory (<storage_path>/<run_name>/checkpoints) so Ray Train can manage them. Set storage_path instead."
            )
        self.scaling_config = _scaling_config(scaling_config, num_workers, use_gpu, resources_per_worker)
        self.datasets = dict(datasets)
        self.storage_path, self.storage_options = _storage_root(storage_path), dict(storage_options or {})
        self.run_name = run_name or datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
        self.max_failures = max_failures
        self.deterministic_split = deterministic_split
        self.ray_callbacks = list(ray_callbacks)
        self.progress_bar = progress_bar
        self.spec = RunSpec(
            model=model,
            optimizers=optimizers,
            schedulers=schedulers,
            algorithms=algorithms,
            callbacks=callbacks,
            max_duration=duration.to_timestring(),
            batch_size=batch_size,
            eval_datasets=sorted(k for k in datasets if k != "train"),
            eval_batch_size=eval_batch_size,
            eval_interval=eval_interval,
            grad_accum=grad_accum,
            precision=precision,
            seed=seed,
            get_num_tokens_in_batch=get_num_tokens_in_batch,
            collate_fn=collate_fn,
            prefetch_batches=prefetch_batches,
            shuffle_buffer_size=shuffle_buffer_size,
            columns=columns,
            steps_per_epoch=steps_per_epoch,
            report_interval=report_interval,
            report_every_s=report_every_s,
            checkpoint=None if checkpoint is None else dataclasses.replace(checkpoint, lock_run_dir=False),
            storage_url=self.storage_path,
            storage_options=self.storage_options,
            run_name=self.run_name,
            config=dict(config or {}),
        )

    @property
    def run_url(self) -> str:
        """Where this run's files live: ``<storage_path>/<run_name>``."""
        from raytrain_events.storage.fs import join

        return join(self.storage_path, self.run_name)

    def fit(self) -> RayResult:
        """Run training on the Ray workers and return the aggregated result."""
        import ray

        from raytrain_events.ray.cluster import ensure_ray

        started_local = ensure_ray(min_cpus=self.scaling_config.num_workers + 2)
        if started_local or not _autoscaling():
            self._check_cluster(ray)
        with self._claim_run_dir():
            return self._fit()

    @contextlib.contextmanager
    def _claim_run_dir(self) -> Iterator[None]:
        """Hold the run dir's ``running`` lock for the whole run and save the run config there."""
        from raytrain_events.storage.exp_dir import RunDir
        from raytrain_events.storage.locks import acquire_lock, release_lock

        lock = acquire_lock(self.run_url, "running", storage_options=self.storage_options, takeover_stale=True)
        try:
            RunDir(self.run_url, self.storage_options).save_config(_plain(self.describe()))
            yield
        finally:
            release_lock(self.run_url, "running", storage_options=self.storage_options, lock=lock)

    def describe(self) -> Dict[str, Any]:
        """The run's plain-data description, saved as the run dir's config.yaml."""
        spec = self.spec
        algorithms = spec.algorithms
        return {
            "run_name": self.run_name,
            "max_duration": spec.max_duration,
            "batch_size": spec.batch_size,
            "num_workers": self.scaling_config.num_workers,
            "use_gpu": bool(self.scaling_config.use_gpu),
            "grad_accum": spec.grad_accum,
            "precision": spec.precision,
            "seed": spec.seed,
            "eval_interval": str(spec.eval_interval),
            "report_interval": None if spec.report_interval is None else str(spec.report_interval),
            "report_every_s": spec.report_every_s,
            "algorithms": "<factory>"
            if callable(algorithms)
            else [a if isinstance(a, (str, dict)) else type(a).__name__ for a in algorithms],
            "checkpoint": None if spec.checkpoint is None else spec.checkpoint.to_dict(),
            "config": spec.config,
        }

    def _fit(self) -> RayResult:
        import ray
        import ray.train

        if self.spec.steps_per_epoch is None:
            # Shards have no length; schedules in epochs or "dur" and epoch ends need one. Each
            # rank gets floor(rows / workers) rows (Ray splits equally), in ceil(rows / batch) batches.
            rows = self.datasets["train"].count() // self.scaling_config.num_workers
            self.spec.steps_per_epoch = -(-rows // self.spec.batch_size)
        from ray.train.torch import TorchTrainer

        from raytrain_events.ray.data import DeterministicSplitDataConfig
        from raytrain_events.ray.history import AggregatingCallback, RunHistory
        from raytrain_events.ray.worker import train_loop_per_worker

        history = RunHistory.remote()
        tune_queue = _tune_queue()
        storage_path, storage_filesystem = _ray_storage(self.storage_path, self.storage_options)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"spec": self.spec},
            scaling_config=self.scaling_config,
            datasets=self.datasets,
            dataset_config=DeterministicSplitDataConfig() if self.deterministic_split else None,
            run_config=ray.train.RunConfig(
                name=self.run_name,
                storage_path=storage_path,
                storage_filesystem=storage_filesystem,
                failure_config=ray.train.FailureConfig(max_failures=self.max_failures),
                callbacks=[AggregatingCallback(history, tune_queue)] + self.ray_callbacks,
            ),
        )
        stop = threading.Event()
        progress = (
            threading.Thread(target=_show_progress, args=(history, self.spec, stop), daemon=True)
            if self.progress_bar
            else None
        )
        if progress is not None:
            progress.start()
        try:
            ray_result = trainer.fit()
        except Exception as exc:
            raise RayTrainingError(_describe_failure(exc, history)) from exc
        finally:
            stop.set()
            if progress is not None:
                progress.join(timeout=5)
        record = ray.get(history.get.remote())
        if ray_result.error is not None:
            raise RayTrainingError(_describe_failure(ray_result.error, history)) from ray_result.error
        return self._result(record["entries"], ray_result)

    def _result(self, entries: List[Dict[str, Any]], ray_result: Any) -> RayResult:
        final = entries[-1] if entries else {}
        timestamp = Timestamp(
            epoch=final.get("time/epoch", 0),
            batch=final.get("time/batch", 0),
            sample=final.get("time/sample", 0),
            token=final.get("time/token", 0),
        )
        checkpoints: List[Any] = []
        if self.spec.checkpoint is not None:
            from raytrain_events.checkpoint.store import list_checkpoints

            checkpoints = list_checkpoints(self.run_url + "/checkpoints", storage_options=self.storage_options)
        return RayResult(
            timestamp=timestamp,
            metrics=dict(final),
            history=entries,
            checkpoints=checkpoints,
            run_url=self.run_url,
            ray_result=ray_result,
        )

    def _check_cluster(self, ray: Any) -> None:
        if getattr(self.scaling_config, "use_gpu", False):
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus < 1:
                raise RuntimeError(
                    "use_gpu=True but this Ray cluster has no GPUs (cluster resources: "
                    f"{ray.cluster_resources()}). Run on a cluster with GPU nodes (see cluster.yaml), or pass use_gpu=False."
                )


def _autoscaling() -> bool:
    """True on a cluster launcher's head node, where the autoscaler can add GPU nodes on demand."""
    return os.path.exists(os.path.expanduser("~/ray_bootstrap_config.yaml"))


def _plain(value: Any) -> Any:
    """``value`` with anything YAML cannot hold (functions, objects) turned into its repr."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _scaling_config(
    scaling_config: Any, num_workers: Optional[int], use_gpu: bool, resources: Optional[Dict[str, float]]
) -> Any:
    from ray.train import ScalingConfig

    if scaling_config is not None:
        if isinstance(scaling_config, Mapping):
            scaling_config = ScalingConfig(**scaling_config)
        workers = scaling_config.num_workers
    else:
        workers = 1 if num_workers is None else num_workers
        scaling_config = ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources)
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"num_workers={workers!r} must be an integer >= 1.")
    return scaling_config


def _storage_root(storage_path: Optional[str]) -> str:
    if storage_path is None:
        return os.path.abspath("runs")
    if "://" not in storage_path:
        return os.path.abspath(os.path.expanduser(storage_path))
    if storage_path.startswith("file://"):
        return os.path.abspath(storage_path[len("file://") :])
    return storage_path


def _ray_storage(storage_url: str, storage_options: Dict[str, Any]):
    """Ray's ``storage_path`` and ``storage_filesystem`` for our fsspec URL and options."""
    if "://" not in storage_url:
        return storage_url, None
    if storage_url.startswith("memory://"):
        raise ValueError(
            "memory:// storage lives inside one process and Ray workers are separate processes: "
            "use a local path, file://, s3://, gs:// or az:// for a Ray run."
        )
    import pyarrow.fs

    from raytrain_events.storage.fs import resolve

    fs, path = resolve(storage_url, storage_options)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def _tune_queue() -> Any:
    """Inside a Tune trial, the queue Tune reads trial results from; else None."""
    try:
        from ray.train._internal.session import get_session
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session
    except ImportError:  # pragma: no cover
        return None
    if not _in_tune_session():
        return None
    return get_session()._get_or_create_inter_actor_queue()


def _describe_failure(exc: BaseException, history: Any) -> str:
    import ray

    message = f"The Ray training run failed: {exc}"
    try:
        error = ray.get(history.get.remote(), timeout=10)["error"]
    except Exception:  # the history actor may be gone with the cluster
        error = None
    if error:
        message += f"\nDriver-side aggregation error: {error}"
    return message


def _show_progress(history: Any, spec: RunSpec, stop: threading.Event) -> None:
    """Driver progress bar: poll the run history and show the global Timestamp."""
    import ray
    from tqdm import tqdm

    duration = Time.from_timestring(spec.max_duration)
    key = {"ep": "time/epoch", "ba": "time/batch", "sp": "time/sample", "tok": "time/token"}[duration.unit.value]
    with tqdm(total=duration.value, unit=duration.unit.value, desc=spec.run_name, dynamic_ncols=True) as bar:
        while not stop.wait(1.0):
            try:
                latest = ray.get(history.latest.remote(), timeout=5)
            except Exception:
                continue
            if latest:
                bar.n = min(latest.get(key, 0), duration.value)
                shown = {
                    k.split("/")[-1]: round(v, 4)
                    for k, v in latest.items()
                    if k.startswith(("train/", "metrics/")) and isinstance(v, float)
                }
                bar.set_postfix(shown, refresh=True)
