"""`RunPlan`: the run's decisions, made once on the driver from the `RunSpec` and shipped to the workers.

`RayTrainer.__init__` makes the plan (``RunPlan.of(spec)``, before Ray starts) and every part reads it
instead of working a decision out again from the options:

* ``batch``: the global batch (`GlobalBatch`, ``data/order.py``): ``global_batch_size``, else
  ``batch_size`` times the data-parallel ranks. The feeder's `TrainDataConfig`, each rank's shard, the
  mixture's 'ba' stages, the ``steps_per_epoch`` check and replica groups' whole-batch cut read it.
* ``order``: the train order (`TrainOrder`): the block seed and the row shuffle. The driver's early start
  of the feeder and every rank's shard (which its loader reads) carry it.
* ``mixture``: the typed mixture run (`MixtureRun`, ``core/mixture_plan.py``; None without
  ``mixture=``): the `MixtureSource` the feeder streams and each rank's `MixtureOrderLoader` plan from it.
* ``checkpoint``: the checkpoint plan (`CheckpointPlan`, ``checkpoint/folder/retention.ray_plan``; None
  without checkpoints): the workers' `CheckpointConfig`, Ray's retention, the driver's resume position.

Frozen and plain (small dataclasses, a `Mixture`), so it pickles into Ray Train's ``train_loop_config``
as it is. No Ray import: `spec_checks` checks a mixture's stages with `mixture_run` on every `RunSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from raytrain_events.checkpoint.folder.retention import CheckpointPlan, ray_plan
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.mixture_online import OnlinePolicy
from raytrain_events.core.mixture_plan import MixtureRun
from raytrain_events.data.order import GlobalBatch, TrainOrder
from raytrain_events.ray.checkpointing.validation import async_eval_names, parse_validation

__all__ = ["RunPlan", "check_online", "global_batch_of", "mixture_run"]


@dataclass(frozen=True)
class RunPlan:
    """The run's decisions (see the module doc)."""

    batch: GlobalBatch
    order: TrainOrder
    workers: Any  #: the worker count (an int), or an elastic group's (min, max)
    mixture: Optional[MixtureRun] = None
    checkpoint: Optional[CheckpointPlan] = None

    @classmethod
    def of(cls, spec: Any) -> RunPlan:
        """The plan of ``spec`` (a `RunSpec`, checked)."""
        checkpoint = None
        if spec.checkpoints.checkpoint is not None:
            checkpoint = ray_plan(
                spec.checkpoints.checkpoint, run_url=spec.storage.run_url, storage_options=spec.storage.storage_options
            )
        return cls(
            batch=global_batch_of(spec),
            order=TrainOrder.of(spec.seed, spec.data.shuffle_buffer_size),
            workers=spec.scaling.workers,
            mixture=mixture_run(spec),
            checkpoint=checkpoint,
        )

    @property
    def global_batch(self) -> Optional[int]:
        """Rows per optimizer step (None for an elastic group: its world size is known at each start)."""
        return self.batch.rows(self.workers) if isinstance(self.workers, int) else None


def global_batch_of(spec: Any) -> GlobalBatch:
    """The run's `GlobalBatch`: ``batch_size`` per rank, ``global_batch_size`` if fixed, the ranks that share
    rows (TP x CP) counted once."""
    return GlobalBatch(spec.data.batch_size, spec.data.global_batch_size, spec.parallelism_spec.batch_group)


def mixture_run(spec: Any) -> Optional[MixtureRun]:
    """The run's `MixtureRun` (None without ``mixture=``), checked: a stage the run cannot place (after its end,
    out of order, a 'dur' stage in a run counted in tokens) fails here, on the driver before Ray starts."""
    if spec.data.mixture is None:
        return None
    mixture = Mixture.from_dict(spec.data.mixture)
    if mixture.online is not None:
        check_online(spec, mixture)
    workers = spec.scaling.workers
    run = MixtureRun.of(
        mixture,
        seed=spec.seed or 0,
        max_duration=spec.max_duration,
        global_batch=global_batch_of(spec).rows(workers) if isinstance(workers, int) else None,
    )
    run.plan()
    return run


def check_online(spec: Any, mixture: Mixture) -> None:
    """An ``online=`` mixture's run, checked on the driver: each source's eval set is evaluated in the loop (its
    loss is what the policy reads: `data/online_mixture.OnlineMixture`; not by ``validation=`` tasks, whose
    results arrive after training went on). Replica groups, which would evaluate apart, refuse ``mixture=``
    already (``ray/replica_checks.py``)."""
    assert mixture.online is not None
    policy = OnlinePolicy.from_dict(mixture.online, mixture.names)
    by_tasks = async_eval_names(parse_validation(spec.checkpoints.validation), spec.data.eval_names)
    in_loop = [n for n in spec.data.eval_names if n not in by_tasks]
    if policy.target is not None and policy.target not in in_loop:
        raise MixtureError(
            f"The mixture's online policy 'target' reads the loss of the task the run is for, but no eval set evaluated "
            f"in the loop is named {policy.target!r} (eval sets: {spec.data.eval_names}). Fix: pass that task's held-out "
            f"rows as datasets={{{policy.target!r}: ...}} (evaluated in the loop, not by validation=), or name its eval "
            "set in online={'target': ...}."
        )
    missing = {n: policy.label(n) for n in mixture.names if policy.label(n) not in in_loop}
    if missing:
        raise MixtureError(
            f"The mixture's online policy reads each source's eval loss, but the sources {sorted(missing)} have no eval "
            f"set evaluated in the loop named {sorted(missing.values())} (eval sets: {spec.data.eval_names}). Fix: pass "
            "each source's held-out rows as datasets={'<source>_eval': ...} and map them, online={'evaluators': "
            "{'<source>': '<source>_eval'}} (evaluated in the loop, not by validation=)."
        )
