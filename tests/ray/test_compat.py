"""The private Ray names raytrain_events relies on: all still there, all used through ray/_compat.py.

A Ray upgrade that renames or removes one fails `test_every_private_ray_name_is_still_there` with
the Ray version and the missing name, instead of a run failing (or silently misbehaving) later.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray

from raytrain_events.ray import _compat

PACKAGE = Path(__file__).resolve().parents[2] / "raytrain_events"

# A private Ray module or attribute: ``ray.train._internal``, ``ray._private``, ``from ray.x import _y``.
_PRIVATE_MODULE = re.compile(r"(?<![\w.])ray(?:\.\w+)*\._\w+")
_PRIVATE_IMPORT = re.compile(r"^\s*from\s+ray(?:\.[\w.]+)?\s+import\s+(?:\(\s*)?_\w+")
# Private attributes of Ray objects the package reads (each one goes through _compat), and loggers
# other than Ray's documented ones ("ray", "ray.data", "ray.train", "ray.tune", "ray.serve").
_PRIVATE_ATTRS = re.compile(
    r"_get_or_create_inter_actor_queue|_in_tune_session|(?<!\w)(?:_time_attr|_max_t)\b|_node_ip_address"
    r"|ENABLE_RAY_CLUSTER|resolve_ip_for_localhost|ray\.train\.v2\.|get_dashboard_dependency_error"
    r"|global_worker_stdstream_dispatcher|\._meta_count|\._logical_plan|iter_internal_ref_bundles"
    r"|_resources_per_worker_not_none|getLogger\(\s*[\"']ray(?=[.\"'])(?!(?:\.data|\.train|\.tune|\.serve)?[\"'])"
    # Ray's file layouts, log formats and environment knobs (also only through _compat).
    r"|ray_current_cluster|ray_bootstrap_config|SessionFileHandler|convert_ndarray_batch_to_torch_tensor_batch"
    r"|RAY_worker_maximum_startup_concurrency|Token authentication is"
)
# In the Ray-facing packages, any private attribute of another object (``dataset._x``, ``scaling._y``):
# our own private helpers are reached through ``self``/``cls``, ``_compat.`` or a ``raytrain_events.`` path.
RAY_FACING = ("ray", "tune", "cli", "report")
_OTHERS_PRIVATE = re.compile(r"(?<![\w.])(?!self\.|cls\.|_compat\.)[A-Za-z]\w*(?:\.\w+)*\._[a-z]\w*")


def _offending(path: Path, code: str) -> bool:
    if _PRIVATE_MODULE.search(code) or _PRIVATE_IMPORT.search(code) or _PRIVATE_ATTRS.search(code):
        return True
    if path.relative_to(PACKAGE).parts[0] not in RAY_FACING:
        return False
    return any(not m.group().startswith("raytrain_events.") for m in _OTHERS_PRIVATE.finditer(code))


def test_every_private_ray_name_is_still_there():
    problems = _compat.check_private_names()
    assert not problems, f"Ray {ray.__version__} lacks private names raytrain_events relies on:\n" + "\n".join(
        f"- {name}: {message}" for name, message in problems
    )


def test_no_private_ray_name_outside_compat():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name.startswith("_compat") and path.parent.name == "ray":  # the table: _compat.py and its parts
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _offending(path, code):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "private Ray names used outside raytrain_events/ray/_compat.py:\n" + "\n".join(offenders)


def test_the_tables_parts_are_all_imported_from_compat_and_all_probed():
    """``_compat.py`` is the one place to import a private name from, and ``check_private_names`` probes every part:
    a name added to ``_compat_data.py`` or ``_compat_train.py`` but not to the table, or a part's probe left out of
    the check, fails here."""
    import inspect

    from raytrain_events.ray import _compat_data, _compat_train

    for part in (_compat_data, _compat_train):
        for name in part.__all__:
            if name.startswith("probe_"):
                assert f"{name})" in inspect.getsource(_compat.check_private_names), f"{name} is not probed"
            else:
                assert name in _compat.__all__ and getattr(_compat, name) is getattr(part, name), name


def test_a_missing_name_fails_loudly_with_the_ray_version():
    class RenamedScheduler:  # a scheduler taking time_attr/max_t that stores them under other names
        def __init__(self, time_attr="time/sample", max_t=10):
            self.time_attribute = time_attr

    with pytest.raises(_compat.RayCompatError, match=rf"Ray {re.escape(ray.__version__)} has no .*_time_attr"):
        _compat.scheduler_time_attr(RenamedScheduler())
    with pytest.raises(_compat.RayCompatError, match=r"_max_t.*raytrain_events/ray/_compat.py"):
        _compat.scheduler_max_t(RenamedScheduler())
    with pytest.raises(_compat.RayCompatError, match="no ray.nowhere.thing"):
        _compat._import("ray.nowhere", "thing")


def test_a_changed_file_layout_log_message_or_knob_fails_naming_the_ray_version(monkeypatch):
    monkeypatch.setattr(_compat, "TOKEN_AUTH_ENABLED", "Token auth is now on")
    monkeypatch.setattr(_compat, "STARTUP_CONCURRENCY_ENV", "RAY_worker_maximum_startup_concurrency_renamed")
    problems = dict(_compat.check_private_names())
    assert set(problems) == {"file layouts and log messages", "RAY_worker_maximum_startup_concurrency"}
    for message in problems.values():
        assert f"Ray {ray.__version__} has no" in message
    assert "Token auth is now on" in problems["file layouts and log messages"]
    assert "worker_maximum_startup_concurrency_renamed" in problems["RAY_worker_maximum_startup_concurrency"]


def test_scheduler_accessors():
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    asha = ASHAScheduler(time_attr="time/token", max_t=77, grace_period=1)
    assert _compat.scheduler_time_attr(asha) == "time/token" and _compat.scheduler_max_t(asha) == 77
    assert _compat.scheduler_time_attr(FIFOScheduler()) is None and _compat.scheduler_max_t(None) is None


def test_the_scan_sees_each_kind_of_private_use():
    """The scan itself can fail: each kind of private use the package once had is caught."""
    ray_file = PACKAGE / "ray" / "data" / "feeder.py"
    for line in [
        "from ray._private.utils import get_dashboard_dependency_error",
        "from ray.data._internal.logical.operators import read_operator",
        "rows = dataset._meta_count()",
        "per_worker = scaling_config._resources_per_worker_not_none['CPU']",
        "iter(dataset.iter_internal_ref_bundles())",
        "with dispatcher._lock:",
        "logging.getLogger(context.__file__ if False else 'ray.train.v2._internal.execution.context')",
        "time_attr = getattr(scheduler, '_time_attr', None)",
    ]:
        assert _offending(ray_file, line), line
    for line in [
        "self._pull_until(start)",
        "from raytrain_events.ray import _compat",
        "rows = _compat.dataset_meta_count(dataset)",
        "from raytrain_events.schedulers._convert import as_time",
        "logging.getLogger('ray.data').handlers",
    ]:
        assert not _offending(ray_file, line), line


def test_worker_line_handler_is_wrapped_and_restored():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    def ours():  # call only our handler: Ray's own printer (once Ray started here) wants whole log records
        return next(handler for name, handler in dispatcher.handlers if name == "raytrain_events_test")

    seen = []
    dispatcher.add_handler("raytrain_events_test", seen.append)
    try:
        restore = _compat.wrap_worker_line_handler("raytrain_events_test", lambda h: lambda data: h({**data, "x": 1}))
        ours()({"lines": ["a"]})
        restore()
        ours()({"lines": ["b"]})
    finally:
        dispatcher.remove_handler("raytrain_events_test")
    assert seen == [{"lines": ["a"], "x": 1}, {"lines": ["b"]}]


def test_dataset_internals(ray_cluster, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from raytrain_events.data.ray.data_config import cheap_row_count

    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "part.parquet")
    read = ray.data.read_parquet(str(tmp_path))
    mapped = read.map_batches(lambda batch: batch)
    assert _compat.is_bare_read(read) and not _compat.is_bare_read(mapped)
    assert cheap_row_count(read) == 10 and cheap_row_count(mapped) is None
    # A bare read_parquet (and a column selection after it) is told apart from one with transforms.
    paths, filesystem, columns = _compat.parquet_read_of(read)
    assert paths == [str(tmp_path)] and filesystem is not None and columns is None
    assert _compat.parquet_read_of(read.select_columns(["x"]))[2] == ["x"]
    shuffled = ray.data.read_parquet(str(tmp_path), shuffle="files")
    for other in (mapped, read.limit(3), read.rename_columns({"x": "y"}), shuffled, ray.data.from_items([{"x": 1}])):
        assert _compat.parquet_read_of(other) is None
    items = ray.data.from_items([{"x": i} for i in range(7)])
    assert _compat.dataset_meta_count(items) == 7
    blocks = list(_compat.iter_block_refs(items))
    assert sum(block.num_rows() for block in blocks) == 7
