"""What `RayTrainer` checks on the driver before Ray starts, so a bad run fails in seconds, not after start-up.

`RunSpec.__post_init__` checks each option's value (types, ranges, names, URLs). This module
checks what needs the user's code: the factories are called once here, on the meta device
(``torch.device("meta")``: no memory, no weights), and what they return is checked as the
worker would use it (a module; optimizers over its parameters; schedulers on those optimizers);
algorithm names are built from the registry (a typo fails here); the datasets' types are
checked, and a mixture's sources (`mixture_source.check_mixture`: each in datasets and seekable,
its rows and its Parquet schema; a bad mixture already failed in `RunSpec`). A factory that cannot run on the driver (it reads files only the workers see, say) is
skipped with one warning: the worker still builds it, as before; a ValueError from a factory (a value
it refuses, like a warmup past the run) is raised here, before Ray starts.

Cost: one call of each factory on the meta device per `RayTrainer`, on the driver; it does not
grow with workers or nodes.
"""

from __future__ import annotations

import logging
from typing import Any, List, Mapping

from raytrain_events.data.ray.mixture_source import check_mixture
from raytrain_events.parallel.context_parallel import check_model
from raytrain_events.parallel.pipeline import check_pipeline_run, check_pipelined_model
from raytrain_events.parallel.tensor_parallel import tensor_parallel_plans
from raytrain_events.ray.data_checks import check_columns, check_steps_per_epoch
from raytrain_events.ray.spec import RunSpec
from raytrain_events.ray.spec_checks import check_mesh
from raytrain_events.storage.fs import refuse_file_folder, resolve
from raytrain_events.trainer.arguments import check_list, check_optimizers, check_schedulers

__all__ = ["check_on_driver"]

log = logging.getLogger(__name__)


def check_on_driver(spec: RunSpec, *, build: bool = True) -> None:
    """Refuse what would fail (or train wrongly) on the workers; see the module doc.

    ``build=False`` (a sweep's base run, whose factories read the trials' config): the factories are
    not called; each trial's `RayTrainer.fit` calls them with its own config.
    """
    check_mesh(spec)  # also with the default single worker (RunSpec checks only an explicit count)
    _check_factory_kinds(spec)
    _check_lists(spec)
    _check_pipeline(spec, model=None)
    if isinstance(spec.data.datasets, Mapping) and spec.data.mixture is not None:
        sources = check_mixture(spec.data.mixture, spec.data.datasets, spec.data.shuffle_buffer_size)
        RunSpec.check_datasets({k: v for k, v in spec.data.datasets.items() if k not in sources})
        check_columns(spec.data.columns, sources)
    elif isinstance(spec.data.datasets, Mapping):
        RunSpec.check_datasets(spec.data.datasets)
        check_columns(spec.data.columns, {k: v for k, v in spec.data.datasets.items() if k == "train"})
        check_steps_per_epoch(spec, spec.data.datasets["train"])
    _check_load_from(spec.checkpoints.checkpoint)
    if build:
        _check_on_meta(spec)


def _check_load_from(checkpoint: Any) -> None:
    """``CheckpointConfig(load_from=...)`` must exist (one listing on the driver; unreachable storage is left
    to the first real read, which names its own problem)."""
    url = getattr(checkpoint, "load_from", None)
    if not url:
        return

    refuse_file_folder(url, checkpoint.storage_options, what="load_from")
    try:
        fs, path = resolve(url, checkpoint.storage_options)
        exists = fs.exists(path)
    except Exception:  # noqa: BLE001 -- unreachable storage: the load reports it with its own message
        return
    if not exists:
        raise FileNotFoundError(
            f"CheckpointConfig(load_from={url!r}): nothing is there. Fix: the folder of a checkpoint (with "
            "manifest.json) or a folder of checkpoints, e.g. <storage_path>/<run_name>/checkpoints; to continue a "
            "run by name use CheckpointConfig(autoresume=True) with its run_name instead."
        )


def _check_factory_kinds(spec: RunSpec) -> None:
    import torch

    if isinstance(spec.model, torch.nn.Module):
        raise TypeError(
            f"model= is a {type(spec.model).__name__} instance; RayTrainer takes a factory that each worker calls to "
            f"build its own copy. Fix: model=lambda: {type(spec.model).__name__}(...) (or a function model(config))."
        )
    if not callable(spec.model):
        raise TypeError(
            f"model={spec.model!r} must be a factory: model(config) -> nn.Module, like model=lambda: Net()."
        )
    optimizers = spec.optimizers
    if isinstance(optimizers, torch.optim.Optimizer) or (
        isinstance(optimizers, (list, tuple)) and any(isinstance(o, torch.optim.Optimizer) for o in optimizers)
    ):
        raise TypeError(
            "optimizers= is an optimizer instance, built on the driver's parameters (not the workers' models). "
            "Fix: pass a factory, optimizers=lambda model: torch.optim.AdamW(model.parameters(), lr=...)."
        )
    if isinstance(optimizers, type):
        raise TypeError(
            f"optimizers={optimizers.__name__} is a class. Fix: pass a factory, optimizers=lambda model: "
            f"{optimizers.__name__}(model.parameters(), lr=...)."
        )
    if not callable(optimizers):
        raise TypeError(
            f"optimizers={optimizers!r} must be a factory: optimizers(model, config) -> optimizer(s), like "
            "optimizers=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3)."
        )
    if isinstance(spec.schedulers, type):
        raise TypeError(
            f"schedulers={spec.schedulers.__name__} is a class. Fix: pass a factory, schedulers=lambda optimizer: "
            f"{spec.schedulers.__name__}(optimizer, ...), or a raytrain_events.schedulers schedule."
        )


def _check_lists(spec: RunSpec) -> None:
    """Algorithms (built from their names here: a typo fails now) and callbacks, unless given as factories."""

    for what in ("algorithms", "callbacks"):
        value = getattr(spec, what)
        if callable(value) and not isinstance(value, type):
            continue  # a factory, called on each worker
        if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{what}={value!r} must be a list (or a factory returning one). Fix: {what}=[{value!r}].")
        if what == "algorithms":
            # why here: defers torch.distributed.tensor until this runs
            from raytrain_events.algorithms.registry import build_algorithms

            check_list(what, build_algorithms(value))
        else:
            check_list(what, value)


def _check_on_meta(spec: RunSpec) -> None:
    """Build the model, optimizers and schedulers once on the meta device and check what came back."""
    import torch

    try:
        with torch.device("meta"):
            model = spec.build_model()
    except ValueError:
        raise  # a refused value (a warmup past the run, a bad config): the workers would fail the same way
    except Exception as exc:  # noqa: BLE001 -- a factory may need the worker's files or devices
        log.warning(
            "Could not check the model factory on the driver (on the meta device): %s: %s. The workers build it.",
            type(exc).__name__,
            exc,
        )
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"The model factory returned {type(model).__name__} {model!r:.80}, not a torch.nn.Module. Fix: return "
            "the model, e.g. model=lambda: ClassifierModel(Net(), num_classes=10)."
        )
    try:
        with torch.device("meta"):
            optimizers = spec.build_optimizers(model)
            schedulers = spec.build_schedulers(optimizers)
    except ValueError:
        raise  # as above: a value the factories refuse is refused here, before Ray starts
    except Exception as exc:  # noqa: BLE001
        log.warning("Could not check the optimizer/scheduler factories on the driver: %s: %s.", type(exc).__name__, exc)
        return
    _check_pipeline(spec, model)
    check_optimizers(optimizers, model)
    _check_parallel_model(spec, model)
    listed: List[Any] = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    check_schedulers(_as_list(schedulers), listed)


def _check_pipeline(spec: RunSpec, model: Any) -> None:
    """Pipeline parallelism: the mesh and algorithms (no model), or the model's stages."""
    config = spec.parallelism_spec.fsdp
    if config is None or config.pipeline_parallel == 1:
        return

    if model is not None:
        check_pipelined_model(model, config)
        return
    algorithms = spec.algorithms if isinstance(spec.algorithms, (list, tuple)) else []
    # why here: defers torch.distributed.tensor until this runs
    from raytrain_events.algorithms.registry import build_algorithms

    check_pipeline_run(config, spec.scaling.workers, build_algorithms(algorithms))


def _as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_parallel_model(spec: RunSpec, model: Any) -> None:
    """Tensor and context parallelism need the model's say: its TP plan (checked against the degree) and
    its sequence split method, refused here on the meta model instead of on every worker."""
    tp, cp = spec.tensor_parallel, spec.parallelism_spec.context_parallel
    if tp > 1:
        tensor_parallel_plans(model, tp)
    if cp > 1:
        check_model(model, cp)
