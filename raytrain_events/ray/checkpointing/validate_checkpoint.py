"""What one asynchronous validation task does: load a checkpoint, evaluate it, record the result.

`CheckpointValidator` is the ``fn`` of Ray Train's ``ValidationConfig`` (`raytrain_events.ray.checkpointing.validation`):
Ray runs it as a task on each checkpoint rank 0 reported with ``validation=True``. It

1. reads the checkpoint's manifest (one small read) for its global `Timestamp`;
2. builds the user's model from the run's model factory and loads the checkpoint into a
   one-process `Trainer` for evaluation (``CheckpointConfig(load_from=...)``: the project's own
   loading, which reshards a sharded checkpoint to this one process);
3. evaluates the chosen eval sets (Ray Datasets, read whole in this task) with ``Trainer.eval``:
   the same `Evaluator` and metrics code as the in-loop evaluation, so the keys match
   (``metrics/<label>/<name>``);
4. appends a history entry at the checkpoint's Timestamp to the run's `RunHistory` actor (and the
   Tune trial's report queue), and returns the metrics to Ray (its checkpoint record).

A failure anywhere in 2-3 is recorded as an entry with ``"validation": "failed"`` and the error,
then re-raised so Ray marks the checkpoint ``VALIDATION_FAILED`` and logs it; the run goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.plain import to_python
from raytrain_events.ray.checkpointing.validation import AsyncValidation, validation_entry

__all__ = ["CheckpointValidator"]

_log = logging.getLogger(__name__)


class CheckpointValidator:
    """Ray Train's validation ``fn(checkpoint) -> metrics`` for one `RayTrainer` run (pickled into each task).

    ``spec``: the run's `RunSpec` (model factory, config, precision, loader options);
    ``datasets``: the eval sets to evaluate, ``{name: ray.data.Dataset}``; ``history``: the run's
    `RunHistory` actor; ``report_queue``: the Tune trial's queue, or None.
    """

    def __init__(
        self,
        spec: Any,
        validation: AsyncValidation,
        datasets: Dict[str, Any],
        history: Any,
        report_queue: Any = None,
    ) -> None:
        self.spec = spec
        self.validation = validation
        self.datasets = dict(datasets)
        self.history = history
        self.report_queue = report_queue

    def __call__(self, checkpoint: Any, **kwargs: Any) -> Dict[str, Any]:
        # why here: defers fsspec, torch until this runs
        from raytrain_events.checkpoint.format.manifest import CheckpointNotCommittedError
        from raytrain_events.checkpoint.format.reader import read_manifest
        from raytrain_events.storage.exp_dir import checkpoints_url
        from raytrain_events.storage.fs import join

        started = time.time()
        name = checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
        url = join(checkpoints_url(self.spec.storage.run_url), name)
        counters: Optional[Dict[str, int]] = None
        # Replica groups' lead names a checkpoint as its (asynchronous) save starts, so the task may come before the
        # commit: it waits up to ``commit_wait_s`` for the manifest (Ray Train's own path calls after the commit: 0).
        deadline = started + float(kwargs.pop("commit_wait_s", 0.0))
        try:
            while True:
                try:
                    info = read_manifest(url, storage_options=self.spec.storage.storage_options)
                    break
                except CheckpointNotCommittedError:
                    if time.time() >= deadline:
                        raise
                    time.sleep(0.5)
            counters = dict(info.timestamp)
            metrics = self.evaluate(url)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            _log.warning("Validation of checkpoint %s failed: %s", name, error)
            self._record(validation_entry(counters, name, started, validation="failed", validation_error=error))
            raise
        self._record(validation_entry(counters, name, started, validation="async", **metrics))
        return metrics

    def evaluate(self, url: str) -> Dict[str, Any]:
        """Load ``url`` into a one-process `Trainer` and evaluate the eval sets; ``{"metrics/<label>/<name>": float}``."""
        import torch

        # why here: defers torch, numpy, pyarrow (the evaluation loop and its data) until this runs
        from raytrain_events.data.ray.loader import ShardLoader
        from raytrain_events.dist import LocalDist
        from raytrain_events.trainer import Trainer
        from raytrain_events.trainer.evaluation import Evaluator

        spec = self.spec
        device = torch.device("cuda" if self.validation.resources.get("GPU") and torch.cuda.is_available() else "cpu")
        batch_size = self.validation.batch_size or spec.data.eval_batch_size or spec.data.batch_size
        evaluators = [
            Evaluator(
                label=label,
                dataloader=ShardLoader(
                    dataset,
                    batch_size=batch_size,
                    device=device,
                    collate_fn=spec.data.collate_fn,
                    prefetch_batches=spec.data.prefetch_batches,
                    columns=spec.data.columns,
                ),
                **{k: v for k, v in spec.data.eval_options.get(label, {}).items() if k != "eval_interval"},
            )
            for label, dataset in self._datasets().items()
        ]
        callbacks: List[Any] = spec.build_list(self.validation.callbacks)
        trainer = Trainer(
            model=spec.build_model(),
            eval_dataloader=evaluators,
            callbacks=callbacks,
            device=device,
            dist=LocalDist(device),
            run_name=f"{spec.storage.run_name}-validation",
            checkpoint=CheckpointConfig(load_from=url, storage_options=dict(spec.storage.storage_options)),
            precision=spec.precision,
            seed=spec.seed,
            config=spec.config,
        )
        try:
            values = trainer.eval()
        finally:
            trainer.close()
        return {k: to_python(v) for k, v in values.items()}

    def _datasets(self) -> Dict[str, Any]:
        """The eval sets as Ray Datasets (an eval set may be Ray Train's zero-argument function returning one)."""
        from ray.data import Dataset

        return {k: v if isinstance(v, Dataset) or not callable(v) else v() for k, v in self.datasets.items()}

    def _record(self, entry: Dict[str, Any]) -> None:
        """Append ``entry`` to the run history and Tune's queue; a lost history must not hide the result."""
        import ray

        try:
            ray.get(self.history.add.remote(entry), timeout=60)
            if self.report_queue is not None:
                self.report_queue.put(dict(entry), timeout=60)
        except Exception:
            _log.warning("Could not record the validation of %s", entry.get("validated_checkpoint"), exc_info=True)
