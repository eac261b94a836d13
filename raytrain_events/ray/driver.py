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

Ray, and our modules that import it, are imported inside the methods that run at fit time, so
``RayTrainer(...)`` and every check before Ray starts run without importing Ray.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Dict, Iterator, List, Optional

from raytrain_events.checkpoint.folder.store import list_checkpoints
from raytrain_events.core.time import COUNTER_UNITS, Timestamp, report_key
from raytrain_events.data.ray.data_config import cheap_row_count
from raytrain_events.data.ray.mixture_source import mixture_train_set
from raytrain_events.data.ray.parquet_seek import as_seekable
from raytrain_events.parallel.world import check_tensor_parallel_world
from raytrain_events.ray import _compat, cluster  # ensure_ray read through it: tests stand in a refusing start
from raytrain_events.ray.checkpointing.checkpointing import delete_unlisted, ray_checkpoint_config, resume_position
from raytrain_events.ray.checkpointing.validate_checkpoint import CheckpointValidator
from raytrain_events.ray.checkpointing.validation import (
    async_eval_names,
    check_validation,
    ray_validation_config,
    training_entries,
    unfinished_validations,
    wait_history_validations,
)
from raytrain_events.ray.cluster import check_data_cpus
from raytrain_events.ray.data_checks import check_steps_per_epoch
from raytrain_events.ray.driver_checks import check_on_driver
from raytrain_events.ray.fault_tolerance import choose
from raytrain_events.ray.guards.watchdog import process_group_timeout_s
from raytrain_events.ray.plan import RunPlan
from raytrain_events.ray.reports.console import announce_config_change, quiet_terminal, train_logging_config
from raytrain_events.ray.reports.follow import HistoryFollower
from raytrain_events.ray.reports.history import AggregatingCallback, RunHistory
from raytrain_events.ray.reports.progress import RunProgress
from raytrain_events.ray.reports.run_loggers import RunLoggers
from raytrain_events.ray.result import RayResult
from raytrain_events.ray.shipped import Shipped
from raytrain_events.ray.spec import RunSpec
from raytrain_events.ray.worker import train_loop_per_worker
from raytrain_events.storage.fs import resolve
from raytrain_events.storage.locks import acquire_lock, release_lock
from raytrain_events.storage.run_dir import RunDir
from raytrain_events.trainer.arguments import check_autoresume_named

__all__ = ["RayTrainer", "RayTrainingError"]


class RayTrainingError(RuntimeError):
    """A Ray Train run failed; the message carries the worker's error and traceback."""


class RayTrainer:
    """Train on Ray Train workers with the same event-driven loop as `Trainer`.

    The run's options are a `RunSpec` (``raytrain_events.ray.spec``: each option's meaning and
    default is there). Pass one, or its fields as keyword arguments (``RayTrainer(model=...,
    optimizers=..., datasets=..., max_duration="2ep", num_workers=2)`` builds the spec), or both
    (the keywords replace the spec's fields). ``model``, ``optimizers`` and ``schedulers`` are
    factories called on each worker: ``model(config) -> nn.Module``, ``optimizers(model, config)``,
    ``schedulers(optimizers, config)`` (each may omit the trailing ``config``). ``datasets`` maps
    names to Ray Datasets: ``"train"`` is required (a Ray Dataset or ``ParquetRowGroups(paths)``, which a
    resume enters at its position: ``data/ray/parquet_seek.py``; a bare ``ray.data.read_parquet(...)``
    is run as one), every other name is an eval set. With ``mixture=`` (a `Mixture` of named
    ``datasets`` entries, each seekable: ``data/ray/mixture_source.py``) the train set is the mixture
    of those entries and there is no ``"train"`` entry.
    ``batch_size`` is per worker.
    """

    def __init__(self, spec: Optional[RunSpec] = None, /, **options: Any) -> None:
        if spec is None:
            spec = RunSpec.from_options(options)
        elif not isinstance(spec, RunSpec):
            raise TypeError(f"RayTrainer takes a RunSpec or keyword options, got {type(spec).__name__} {spec!r}.")
        elif options:
            spec = spec.replace(**options)
        self.spec: RunSpec = spec
        self._report_queue: Any = None
        check_autoresume_named(
            spec.checkpoints.checkpoint,
            named=not spec.storage.default_run_name,
            fix="name the run, RayTrainer(run_name='my-run', ...), with the same name (and storage_path) in every job "
            "that continues it.",
        )
        # The run's decisions (global batch, train order, mixture run, checkpoint plan), made once here and
        # shipped to the workers (ray/plan.py).
        self.plan: RunPlan = RunPlan.of(spec)
        # How the run survives a failure, checked (replica groups: what they support, torchft installed) and
        # chosen once: it hands the driver and the workers their parts.
        self._fault_tolerance = choose(spec, self.plan)
        if isinstance(spec.scaling.workers, int):  # an elastic group's size is checked at each worker start
            check_tensor_parallel_world(
                spec.scaling.workers, spec.tensor_parallel, spec.parallelism_spec.context_parallel
            )

    @property
    def run_name(self) -> str:
        return self.spec.storage.run_name  # type: ignore[return-value]

    @property
    def storage_path(self) -> str:
        return self.spec.storage.storage_path  # type: ignore[return-value]

    @property
    def storage_options(self) -> Dict[str, Any]:
        return self.spec.storage.storage_options

    @property
    def scaling_config(self) -> Any:
        """The run's ``ray.train.ScalingConfig``."""
        return self.spec.scaling.ray_scaling_config()

    @property
    def run_url(self) -> str:
        """Where this run's files live: ``<storage_path>/<run_name>``."""
        return self.spec.storage.run_url

    def fit(self, *, report_queue: Any = None) -> RayResult:
        """Run training on the Ray workers and return the aggregated result.

        ``report_queue``: a ``ray.util.queue.Queue`` that also receives every aggregated history
        entry as it arrives (a Tune trial forwards them with ``ray.tune.report``, see
        ``raytrain_events.tune.trial``); None: the entries go only to the history and result.
        """
        self._report_queue = report_queue

        check_on_driver(self.spec)  # the factories on the meta device, algorithm names, datasets: before Ray starts
        import ray

        started_local = cluster.ensure_ray(
            min_cpus=self.scaling_config.max_workers + 2, verbose=self.spec.reports.verbose
        )
        self._checks_cluster = started_local or not _autoscaling()
        if self._checks_cluster:
            self._check_cluster(ray)
        self._progress = None
        datasets = list(self.spec.data.datasets.values()) if isinstance(self.spec.data.datasets, dict) else []
        with self._claim_run_dir(), quiet_terminal(self.spec.reports.verbose, self._write_line, datasets):
            return self._fit()

    def _write_line(self, line: str, stream: Any) -> None:
        """A worker's line that reaches the terminal: above the progress bar if there is one."""
        if self._progress is not None:
            self._progress.write(line)
        else:
            stream.write(line + "\n")
            stream.flush()

    @contextlib.contextmanager
    def _claim_run_dir(self) -> Iterator[None]:
        """Hold the run dir's ``running`` lock for the whole run and save the run config there."""

        lock = acquire_lock(self.run_url, "running", storage_options=self.storage_options, takeover_stale=True)
        try:
            if getattr(self.spec.checkpoints.checkpoint, "autoresume", False):  # once, here: the workers log it at INFO
                announce_config_change(self.run_url, self.storage_options, self.spec.config)
            RunDir(self.run_url, self.storage_options).save_config(self.describe())
            yield
        finally:
            release_lock(self.run_url, "running", storage_options=self.storage_options, lock=lock)

    def describe(self) -> Dict[str, Any]:
        """The run's plain-data description (`RunSpec.describe`), saved as the run dir's config.yaml."""
        return self.spec.describe()

    def _fit(self) -> RayResult:
        # Ray and our modules that import it load at fit time: RayTrainer(...) and its checks run without Ray.
        import ray

        datasets, train_rows = self._datasets(ray)
        worker_spec = self.spec.for_workers(datasets=datasets)

        eval_names = sorted(k for k in datasets if k != "train")
        checkpoints = self.spec.checkpoints
        check_validation(checkpoints.validation, checkpoints.checkpoint, eval_names)  # a datasets factory's names
        validated = async_eval_names(checkpoints.validation, eval_names)  # evaluated as Ray tasks, not by the workers
        history = _run_history(ray)
        validation_config = self._validation_config(worker_spec, datasets, validated, history)
        data_config = self._fault_tolerance.data_config(train_rows)
        feeder = self._start_feeder(data_config, datasets["train"])
        ray_datasets = {k: v for k, v in datasets.items() if k not in validated}
        worker_side, ray_datasets = self._fault_tolerance.worker_side(data_config, ray_datasets, history)
        trainer = self._torch_trainer(
            {"run": Shipped({"spec": worker_spec, "plan": self.plan, "fault_tolerance": worker_side})},
            ray_datasets,
            data_config,
            validation_config,
            history,
        )
        ray_result = self._follow(trainer, history, bool(validated), feeder)
        record = ray.get(history.get.remote())
        self._save_history(history)
        if ray_result.error is not None:
            raise RayTrainingError(_describe_failure(ray_result.error, history)) from ray_result.error
        return self._result(record["entries"], ray_result)

    def _datasets(self, ray: Any) -> Any:
        """The run's datasets as Ray Train gets them (a mixture's sources as one ``"train"`` set, a bare
        ``read_parquet`` seekable), checked, and the train set's row count where it is cheap."""

        datasets = self.spec.build_datasets()
        if self.plan.mixture is not None:  # the sources become one seekable "train" set (mixture_source.py)
            datasets = mixture_train_set(self.spec, datasets, self.plan.mixture)
        self.spec.check_datasets(datasets)
        if self._checks_cluster:
            check_data_cpus(ray.cluster_resources(), self.scaling_config, datasets)

        datasets["train"] = as_seekable(datasets["train"])  # a bare read_parquet seeks (parquet_seek.py)
        return datasets, self._train_rows(datasets["train"])

    def _validation_config(self, worker_spec: RunSpec, datasets: Dict[str, Any], validated: List[str], history: Any):
        """Ray Train's validation config for the eval sets ``validated`` as Ray tasks (None: none are)."""
        if not validated:
            return None
        import ray

        validation = self.spec.checkpoints.validation
        validator = CheckpointValidator(
            worker_spec, validation, {k: datasets[k] for k in validated}, history, self._report_queue
        )
        # and for the checkpoints Ray Train never sees (replica groups' lead asks the history for them)
        ray.get(history.validate_checkpoints.remote(validator, validation))
        return ray_validation_config(validator, validation)

    def _start_feeder(self, data_config: Any, train: Any) -> Any:
        """The train stream, started now at the run's resume position while Ray Train starts the workers
        (None for an elastic group, sized only at its start)."""
        self._data_start = None
        if not isinstance(self.spec.scaling.workers, int):
            return None

        start = resume_position(self.plan.checkpoint)
        return data_config.start_feeder(train, self.spec.scaling.workers, start)

    def _torch_trainer(
        self, train_config: Dict[str, Any], datasets: Dict[str, Any], data_config: Any, validation: Any, history: Any
    ) -> Any:
        """Ray Train's ``TorchTrainer`` for the run: the strategy's configs, the run's storage and callbacks."""
        import ray.train
        from ray.train.torch import TorchTrainer

        storage_path, storage_filesystem = ray_storage(self.storage_path, self.storage_options)
        # The watchdog's hang_timeout, with a margin: the watchdog names a hung rank before this fires.
        torch_options = {"timeout_s": int(process_group_timeout_s(self.spec.failures.hang_timeout))}
        return TorchTrainer(
            train_loop_per_worker,
            torch_config=self._fault_tolerance.torch_config(torch_options),
            train_loop_config=train_config,
            scaling_config=self.scaling_config,
            datasets=datasets,
            validation_config=validation,
            dataset_config=data_config,
            run_config=ray.train.RunConfig(
                name=self.run_name,
                storage_path=storage_path,
                storage_filesystem=storage_filesystem,
                failure_config=self._fault_tolerance.failure_config(),
                callbacks=[
                    AggregatingCallback(history, self._report_queue),
                    *self.spec.reports.ray_callbacks,
                    *self._fault_tolerance.run_callbacks(),
                ],
                logging_config=train_logging_config(self.spec.reports.verbose),
                # Ray owns retention of the checkpoints reported to it (see ray/checkpointing/checkpointing.py).
                checkpoint_config=ray_checkpoint_config(self.plan.checkpoint),
            ),
        )

    def _follow(self, trainer: Any, history: Any, validated: bool, feeder: Any) -> Any:
        """Run ``trainer`` while the progress bar and the driver's loggers follow the history; Ray's result."""
        import ray

        show_bar = self.spec.reports.progress_bar
        show_bar = sys.stderr.isatty() if show_bar is None else show_bar  # by default where someone watches
        progress = self._progress = RunProgress(self.spec.max_duration, self.run_name) if show_bar else None
        loggers = RunLoggers(
            self.spec.reports.driver_loggers, step=self.spec.reports.log_step, hyperparameters=self.describe()
        )
        consumers = ([progress] if progress is not None else []) + ([loggers] if loggers.destinations else [])
        try:
            with HistoryFollower(history, consumers):
                ray_result = trainer.fit()
                if validated:  # Ray waited for its validations, this waits for the history's: record what left none
                    wait_history_validations(history, self.spec.checkpoints.validation)
                    self._record_unfinished_validations(history)
        except Exception as exc:
            self._save_history(history, failed=True)
            raise RayTrainingError(_describe_failure(exc, history)) from exc
        finally:
            if progress is not None:
                progress.close()
                self._progress = None
            loggers.close()
            if feeder is not None:
                self._data_start = _feeder_start(feeder)
                ray.kill(feeder)
        return ray_result

    def _record_unfinished_validations(self, history: Any) -> None:
        import ray

        entries = ray.get(history.get.remote())["entries"]
        for entry in unfinished_validations(entries, self.spec.checkpoints.validation):
            ray.get(history.add.remote(entry))
            if self._report_queue is not None:
                self._report_queue.put(dict(entry))

    def _save_history(self, history: Any, failed: bool = False) -> None:
        """Append this fit's reports to the run dir's history file (what `raytrain-events report` plots)."""
        import ray

        try:
            entries = ray.get(history.get.remote(), timeout=30)["entries"]
            RunDir(self.run_url, self.storage_options).append_history(entries)
        except Exception:
            if not failed:  # a failed run raises its own error; a finished one must not lose its history
                raise

    def _result(self, entries: List[Dict[str, Any]], ray_result: Any) -> RayResult:
        trained = training_entries(entries)  # validation entries arrive late, at their checkpoints' Timestamps
        final = trained[-1] if trained else {}
        timestamp = Timestamp(**{name: final.get(report_key(name), 0) for name in COUNTER_UNITS})
        checkpoints: List[Any] = []
        plan = self.plan.checkpoint
        if plan is not None:
            folder, options = plan.worker.save_folder, plan.worker.storage_options
            if plan.prunes:
                delete_unlisted(folder, options, _listed_by_ray(ray_result))
            checkpoints = list_checkpoints(folder, storage_options=options)
        return RayResult(
            timestamp=timestamp,
            metrics=dict(final),
            history=entries,
            checkpoints=checkpoints,
            run_url=self.run_url,
            ray_result=ray_result,
            metric=None if self.spec.checkpoints.checkpoint is None else self.spec.checkpoints.checkpoint.metric,
            mode="max" if self.spec.checkpoints.checkpoint is None else self.spec.checkpoints.checkpoint.mode,
            data_start=self._data_start,
        )

    def _train_rows(self, train: Any) -> Optional[int]:
        """The train set's row count where it is cheap; never runs a preprocessing pipeline to count."""
        rows = cheap_row_count(train)
        if rows is not None:  # a Ray Dataset's count is known only now: steps_per_epoch must agree with it
            check_steps_per_epoch(self.spec, train, rows)
        if rows is None and self.spec.data.steps_per_epoch is None:
            raise ValueError(
                "The train dataset's row count is not known without running its whole pipeline (it is not in "
                "the metadata, e.g. after map_batches or filter), and the loop needs batches per epoch for epoch "
                "ends and 'ep'/'dur' times. Pass steps_per_epoch=<global batches per epoch> to RayTrainer, or "
                "materialize the dataset first (ds.materialize())."
            )
        return rows

    def _check_cluster(self, ray: Any) -> None:
        if getattr(self.scaling_config, "use_gpu", False):
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus < 1:
                raise RuntimeError(
                    "use_gpu=True but this Ray cluster has no GPUs (cluster resources: "
                    f"{ray.cluster_resources()}). Run on a cluster with GPU nodes (see cluster.yaml), or pass use_gpu=False."
                )


def _run_history(ray: Any) -> Any:
    """The run's `RunHistory` actor, on the driver's node as Ray Train attaches its controller: a lost worker
    node must not take the run's history along (soft affinity let a loaded head spill it onto a node that left)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    driver_node = ray.get_runtime_context().get_node_id()
    return RunHistory.options(scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=False)).remote()


def _listed_by_ray(ray_result: Any) -> List[str]:
    """The checkpoint directory names Ray's final run snapshot holds (kept ones and the latest)."""
    found = [c for c, _ in ray_result.best_checkpoints or []] + [ray_result.checkpoint]
    return [c.path.rstrip("/").rsplit("/", 1)[-1] for c in found if c is not None]


def _feeder_start(feeder: Any) -> Optional[Dict[str, Any]]:
    """The feeder's record of what the run's first batch waited for (kept on `RayResult.data_start`), and a
    line saying it: the stream started early, or where the ranks asked instead. None, with a line saying
    why, when the feeder cannot answer (it died and restarted empty, or did not answer within a minute)."""
    import ray

    log = logging.getLogger(__name__)
    try:
        report: Dict[str, Any] = ray.get(feeder.start_report.remote(), timeout=60)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.info("Train data: the feeder did not say when the stream started (%s).", type(exc).__name__)
        return None
    if "asked" not in report or "prestarted" not in report:  # no prestart, or no rank asked this feeder
        return report
    (epoch, position, _), asked = report["prestarted"], report["asked"]
    if report["used"]:
        log.info(
            "Train data: the stream of epoch %d from sample %d started %.1f s before the first rank asked; "
            "%d rows were in the feeder's buffer then (its reads run further ahead).",
            epoch,
            position,
            report["lead_s"],
            report["rows_ready"],
        )
    else:
        log.info(
            "Train data: the stream started early at epoch %d, sample %d, but the first rank asked for epoch %d "
            "from sample %d (another checkpoint or order): it started there, at the request.",
            epoch,
            position,
            asked[0],
            asked[1],
        )
    return report


def _autoscaling() -> bool:
    """True on a cluster launcher's head node, where the autoscaler can add GPU nodes on demand."""

    return _compat.on_launched_cluster()


def ray_storage(storage_url: str, storage_options: Dict[str, Any]):
    """Ray's ``storage_path`` and ``storage_filesystem`` for our fsspec URL and options (one Ray's workers can
    share: `spec_checks.check_ray_storage` refused the others before Ray started)."""
    if "://" not in storage_url:
        return storage_url, None
    import pyarrow.fs

    fs, path = resolve(storage_url, storage_options)
    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


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
