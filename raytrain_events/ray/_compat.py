"""Every private Ray name this package uses, in one place.

Ray may rename or remove a private name in any release. Each use goes through a function here, which raises
`RayCompatError` naming the Ray version and the missing name instead of failing somewhere deep in a run (or, worse,
silently doing nothing). `check_private_names()` probes them all; tests/ray/test_compat.py runs it, so a Ray upgrade
that removes one fails one test loudly.

This module is the table and the one place to import them from; the names live by what they serve: this file holds the
driver process's (Tune's schedulers, the console, starting a local instance) and the probes of all;
``_compat_data.py`` Ray Data's and the object store's counters; ``_compat_train.py`` Ray Train V2's on a worker;
``_compat_worker_group.py`` the worker group's methods wrapped for replica groups of several workers; and
``_compat_lookup.py`` the lookup every one goes through (`RayCompatError`).

Private names used (checked against Ray 2.60.0):

* ``TrialScheduler._time_attr`` / ``._max_t`` (ASHA, HyperBand, median stopping, PBT): the sweep checks the scheduler's
  time attribute is one we report, and tells "stopped at the budget" from "stopped early" (Tune has no getter).
* ``PopulationBasedTraining._trial_state`` (each trial's ``last_score``): a trial's score is forgotten at its final
  report, so PBT ranks it no more (`pbt_retire_trial`, `raytrain_events.tune.pbt_end`), as Tune does once the trial's
  function has returned (``_quantiles`` ranks trials with a score that are not finished).
* ``ray._private.utils.get_dashboard_dependency_error``: whether the dashboard can start, so an embedded instance gets
  one on a known loopback port (`raytrain_events.ray.reports.console`).
* ``ray._private.ray_logging.global_worker_stdstream_dispatcher`` (its ``handlers`` list and ``_lock``): the driver-side
  handler that prints the workers' forwarded lines; the console wraps it against noise (`wrap_worker_line_handler`).
* Ray Data: ``Dataset._meta_count()`` (rows from metadata, never computing), ``Dataset._logical_plan`` with
  ``ray.data._internal.logical.operators.read_operator`` (is the dataset a bare file read?) and
  ``Dataset.iter_internal_ref_bundles()`` (the blocks, in order, without pulling them to the caller: the global-order
  feeder slices them). For ``read_parquet`` detection (`parquet_read_of`): the plan's operators ``ReadFiles``
  (``datasource_name``, ``block_udf``, ``scanner``: ``columns``, ``predicate``, ``limit``, ``shuffle``,
  ``partition_predicate``), ``ListFiles`` (``paths``, ``filesystem``, ``file_extensions``, ``partition_filter``,
  ``predicate``, ``limit``) and ``Project`` (``exprs`` of ``ColumnExpr``), each with ``input_dependencies``.
* Ray Train V2's worker: ``ray.train.v2._internal.execution.context.get_train_context()
  .preemption_context.preemption_info`` (the notice Ray's preemption watcher left on this worker, read without the
  cross-worker barrier of ``ray.train.get_preemption_info()``, so the loop can look every batch and agree through its
  own per-batch collective), and the worker actor's ``execute(fn)`` method, called on the worker's own actor to run
  ``fn`` on its main thread (the only thread that may set a signal handler; the train function runs on another):
  `local_preemption_info`, `run_on_worker_main_thread` (`raytrain_events.ray.guards.preemption`). And
  ``ray.train.v2.torch.torchft_config.TorchftConfig``, replica groups' backend (`torchft_config_class`), and
  ``ray.train.v2._internal.exceptions.WorkerHealthCheckFailedError`` / ``WorkerHealthCheckTimeoutError``, what the
  controller gives a worker whose process or node is gone (`worker_death_errors`: the failure record names the rank
  that died before those whose collectives failed with it, `raytrain_events.ray.reports.failures`). And the train
  context's ``report_call_index`` and ``current_report_index``: how many of this worker's reports Ray has not handed to
  its controller yet (`reports_waiting`: `RayReporter` lets a few reports wait in Ray's thread, not in training).
* ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` and ``ray.init(_node_ip_address=...)``: keep an embedded local
  instance on 127.0.0.1 (`loopback_only`).
* ``ray._private.internal_api.node_stats`` (a raylet's ``GetNodeStats`` reply, its object store's
  ``cumulative_created_bytes``): the bytes each node's object store has taken in, which counts the objects pulled from
  other nodes -- Ray's own figure for a test of network bytes per epoch (`object_store_created_bytes`,
  ``tests/data/ray/network_run.py``); and ``object_store_bytes_used``, what it holds now (`object_store_used_bytes`, the peak
  in ``bench/data_scale.py``).

Ray's file layouts, log formats and environment knobs this package relies on (same rules: one function or constant here
each, probed by `check_private_names()`):

* ``RAY_worker_maximum_startup_concurrency`` (`STARTUP_CONCURRENCY_ENV`): a raylet setting read from the environment;
  probed in the raylet binary (`raytrain_events.ray.embedded`).
* ``<ray temp dir>/ray_current_cluster`` (`ray_address_file`, from ``ray._common.utils``): the file ``ray start`` writes
  its address to (`raytrain_events.ray.cluster`).
* ``~/ray_bootstrap_config.yaml`` (`on_launched_cluster`): the file the cluster launcher puts on every node it starts,
  which Ray Tune reads the same way (``ray.tune.execution.cluster_info``).
* Ray Data's and Ray Train's ``SessionFileHandler`` classes (`is_session_file_handler`): their logging handlers that
  write to the session's log files, which the console leaves alone.
* ``ray.data.util.torch_utils.convert_ndarray_batch_to_torch_tensor_batch`` (`ndarray_batch_to_torch`): Ray Data's own
  NumPy-to-torch batch conversion (`raytrain_events.data.ray.loader`).
* The token-authentication notice of ``ray._private.authentication.authentication_token_setup`` (`TOKEN_AUTH_LOGGER`,
  `TOKEN_AUTH_ENABLED`) and the session's log folder (`session_logs_dir`): an embedded instance's notice goes to that
  folder instead of the terminal (`raytrain_events.ray.cluster`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import mmap
import os
from types import SimpleNamespace
from typing import Any, Callable, Iterator, List, Optional, Tuple

from raytrain_events.ray._compat_data import (
    dataset_meta_count,
    is_bare_read,
    iter_block_refs,
    ndarray_batch_to_torch,
    object_store_created_bytes,
    object_store_used_bytes,
    parquet_read_of,
    probe_data,
    probe_node_stats,
)
from raytrain_events.ray._compat_lookup import RayCompatError, _attr, _import, _missing
from raytrain_events.ray._compat_train import (
    local_preemption_info,
    probe_train_worker,
    reports_waiting,
    run_on_worker_main_thread,
    torchft_config_class,
    worker_death_errors,
)

__all__ = [
    "RayCompatError",
    "scheduler_time_attr",
    "scheduler_max_t",
    "pbt_retire_trial",
    "dashboard_installed",
    "wrap_worker_line_handler",
    "dataset_meta_count",
    "is_bare_read",
    "iter_block_refs",
    "parquet_read_of",
    "LOOPBACK_INIT_KWARGS",
    "loopback_only",
    "STARTUP_CONCURRENCY_ENV",
    "ray_address_file",
    "on_launched_cluster",
    "is_session_file_handler",
    "ndarray_batch_to_torch",
    "TOKEN_AUTH_LOGGER",
    "TOKEN_AUTH_ENABLED",
    "session_logs_dir",
    "check_private_names",
    "local_preemption_info",
    "run_on_worker_main_thread",
    "object_store_created_bytes",
    "object_store_used_bytes",
    "torchft_config_class",
    "worker_death_errors",
    "reports_waiting",
]

#: ``ray.init`` keyword arguments that pin a new local instance's node address to loopback.
LOOPBACK_INIT_KWARGS = {"_node_ip_address": "127.0.0.1"}
_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: The raylet's cap on worker processes starting at once, read from the environment at its start.
STARTUP_CONCURRENCY_ENV = "RAY_worker_maximum_startup_concurrency"
_BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
#: The logger and message start of the notice ``ray.init`` logs when it turns token auth on by default.
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_ENABLED = "Token authentication is enabled for this Ray cluster"


def _takes_time_attr(scheduler: Any) -> bool:
    try:
        return "time_attr" in inspect.signature(type(scheduler).__init__).parameters
    except (TypeError, ValueError):
        return False


def scheduler_time_attr(scheduler: Any) -> Optional[str]:
    """The result key a Tune scheduler measures time by (None for schedulers without one)."""
    if scheduler is None or not _takes_time_attr(scheduler):
        return None
    return _attr(scheduler, "_time_attr")


def scheduler_max_t(scheduler: Any) -> Any:
    """A Tune scheduler's time budget per trial (None for schedulers without one)."""
    if scheduler is None or "max_t" not in inspect.signature(type(scheduler).__init__).parameters:
        return None
    return _attr(scheduler, "_max_t")


def dashboard_installed() -> bool:
    """Whether this Ray can start its dashboard (its optional dependencies are installed)."""
    get_error = _import("ray._private.utils", "get_dashboard_dependency_error")
    return get_error() is None


def wrap_worker_line_handler(name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace the driver's handler ``name`` of forwarded worker lines by ``wrap(handler)``; returns the undo.

    Ray registers ``"ray_print_logs"`` on ``global_worker_stdstream_dispatcher``: it prints each
    batch of lines the workers wrote (a dict with ``lines``, ``pid``, ``actor_name``...).
    """
    dispatcher = _import("ray._private.ray_logging", "global_worker_stdstream_dispatcher")
    lock = _attr(dispatcher, "_lock")
    with lock:
        original = list(_attr(dispatcher, "handlers"))
        dispatcher.handlers = [(key, wrap(handler) if key == name else handler) for key, handler in original]

    def restore() -> None:
        with lock:
            dispatcher.handlers = original

    return restore


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """While starting a local instance: every address Ray picks is 127.0.0.1, whatever the import order.

    Ray picks a new node's address with ``services.get_node_ip_address()``: the address of the
    interface that routes outside unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false, a constant
    read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ``ray`` is first imported (so setting the
    variable later does nothing in this process). ``ray.init(_node_ip_address="127.0.0.1")`` alone
    does not help either: ``init`` turns a loopback address back into that same routable one
    (``resolve_ip_for_localhost``). So, for the duration of the start: the constant is false in
    this process, and the variable is ``"0"`` in the environment the GCS, raylet and workers
    inherit (they read it at their own import); both are restored afterwards, so a later
    connection to a real cluster from this process is unaffected.
    """
    constants = importlib.import_module("ray._private.ray_constants")
    if not hasattr(constants, "ENABLE_RAY_CLUSTER"):
        raise _missing("ray._private.ray_constants.ENABLE_RAY_CLUSTER")
    previous_constant = constants.ENABLE_RAY_CLUSTER
    previous_env = os.environ.get(_CLUSTER_ENV)
    constants.ENABLE_RAY_CLUSTER = False
    os.environ[_CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = previous_constant
        if previous_env is None:
            os.environ.pop(_CLUSTER_ENV, None)
        else:
            os.environ[_CLUSTER_ENV] = previous_env


def ray_address_file() -> str:
    """The file ``ray start`` writes the cluster's address to (``/tmp/ray/ray_current_cluster``)."""
    return str(_import("ray._common.utils", "get_ray_address_file")(None))


def on_launched_cluster() -> bool:
    """True on a node the Ray cluster launcher started (it leaves its bootstrap config in the home folder)."""
    return os.path.exists(os.path.expanduser(_BOOTSTRAP_CONFIG))


def _session_file_handler_classes() -> Tuple[type, ...]:
    return (
        _import("ray.data._internal.logging", "SessionFileHandler"),
        _import("ray.train.v2._internal.logging.logging", "SessionFileHandler"),
    )


def is_session_file_handler(handler: Any) -> bool:
    """Whether a logging handler is one of Ray's that write to the session's log files."""
    return isinstance(handler, _session_file_handler_classes())


def session_logs_dir() -> Optional[str]:
    """The connected Ray session's log folder on this node (None when not connected to a local node)."""
    worker = _import("ray._private.worker", "global_worker")
    node = getattr(worker, "node", None)
    return None if node is None else str(_attr(node, "get_logs_dir_path")())


def _probe_startup_concurrency() -> None:
    """The raylet binary still knows the setting (a renamed one would be ignored without a word)."""
    import ray

    path = os.path.join(os.path.dirname(ray.__file__), "core", "src", "ray", "raylet", "raylet")
    key = STARTUP_CONCURRENCY_ENV[len("RAY_") :].encode()
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found = data.find(key) >= 0
    except OSError as exc:
        raise _missing(f"the raylet binary at {path}", exc) from exc
    if not found:
        raise _missing(f"a raylet setting {key.decode()} (environment variable {STARTUP_CONCURRENCY_ENV})")


def pbt_retire_trial(scheduler: Any, trial: Any) -> None:
    """Take ``trial`` out of a PBT scheduler's ranking from now on: neither copied into nor copied from."""
    state = _attr(scheduler, "_trial_state").get(trial)
    if state is not None:
        _attr(state, "last_score")
        state.last_score = None


def _probe_pbt_retire() -> None:
    """Two scored trials are ranked against each other; once one is retired, neither is (one trial alone is not)."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import PopulationBasedTraining

    pbt = PopulationBasedTraining(
        time_attr="time/sample", metric="loss", mode="min", perturbation_interval=1, hyperparam_mutations={"lr": [0.1]}
    )
    trials = [Trial("__fake", stub=True) for _ in range(2)]
    for score, trial in enumerate(trials):
        pbt.on_trial_add(SimpleNamespace(search_alg=None), trial)
        _attr(pbt, "_trial_state")[trial].last_score = float(score)
    _expect(tuple(map(len, _attr(pbt, "_quantiles")())), (1, 1), "PopulationBasedTraining._quantiles of two trials")
    pbt_retire_trial(pbt, trials[1])
    _expect(
        tuple(map(len, _attr(pbt, "_quantiles")())), (0, 0), "PopulationBasedTraining._quantiles after a retired trial"
    )


def _probe_source(module: str, text: str, what: str) -> None:
    if text not in inspect.getsource(importlib.import_module(module)):
        raise _missing(f"{what} in {module}")


def _probe_files_and_logs() -> None:
    """The file layouts and log messages above, read off Ray's own source (nothing runs)."""
    if os.path.basename(ray_address_file()) != "ray_current_cluster":
        raise _missing("the cluster address file ray_current_cluster")
    _probe_source("ray.tune.execution.cluster_info", "ray_bootstrap_config.yaml", "the launcher's bootstrap config")
    _probe_source(TOKEN_AUTH_LOGGER, TOKEN_AUTH_ENABLED, f"the notice {TOKEN_AUTH_ENABLED!r}")
    _probe_source(TOKEN_AUTH_LOGGER, "getLogger(__name__)", "a module logger")
    _session_file_handler_classes()
    _import("ray.data.util.torch_utils", "convert_ndarray_batch_to_torch_tensor_batch")
    _attr(_import("ray._private.node", "Node"), "get_logs_dir_path")


def check_private_names() -> List[Tuple[str, str]]:
    """Probe every private name above; return ``(name, problem)`` for each one that is gone."""
    from ray.tune.schedulers import ASHAScheduler

    problems: List[Tuple[str, str]] = []

    def probe(name: str, fn: Any) -> None:
        try:
            fn()
        except RayCompatError as exc:
            problems.append((name, str(exc)))

    asha = ASHAScheduler(time_attr="time/sample", max_t=10, grace_period=1)
    probe("scheduler _time_attr", lambda: _expect(scheduler_time_attr(asha), "time/sample", "ASHAScheduler._time_attr"))
    probe("scheduler _max_t", lambda: _expect(scheduler_max_t(asha), 10, "ASHAScheduler._max_t"))
    probe("PBT trial state last_score", _probe_pbt_retire)
    probe("get_dashboard_dependency_error", lambda: _import("ray._private.utils", "get_dashboard_dependency_error"))
    probe("worker line dispatcher", lambda: wrap_worker_line_handler("ray_print_logs", lambda handler: handler)())
    probe("ray_print_logs handler", _expect_print_logs_handler)
    probe("Ray Data internals", probe_data)
    probe("Ray Train worker internals", probe_train_worker)
    probe("ENABLE_RAY_CLUSTER", lambda: _import("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"))
    probe("RAY_worker_maximum_startup_concurrency", _probe_startup_concurrency)
    probe("file layouts and log messages", _probe_files_and_logs)
    probe("node_stats cumulative_created_bytes", probe_node_stats)
    probe("TorchftConfig", torchft_config_class)
    if not _init_takes("_node_ip_address"):
        problems.append(("_node_ip_address", str(_missing("ray.init(_node_ip_address=...)"))))
    return problems


def _expect(value: Any, expected: Any, name: str) -> None:
    if value != expected:
        raise _missing(f"{name} holding the value given to the constructor (got {value!r}, expected {expected!r})")


def _init_takes(private_kwarg: str) -> bool:
    """``ray.init`` takes its private options through ``**kwargs``: look for the one it pops."""
    worker = importlib.import_module("ray._private.worker")
    return f'kwargs.pop("{private_kwarg}"' in inspect.getsource(worker.init)


def _expect_print_logs_handler() -> None:
    """Ray registers the handler by that name when a driver connects (``ray._private.worker``)."""
    worker = importlib.import_module("ray._private.worker")
    if '"ray_print_logs"' not in inspect.getsource(worker):
        raise _missing('a "ray_print_logs" handler on global_worker_stdstream_dispatcher')
