"""Importing raytrain_events is cheap and side-effect free (it runs inside Ray workers, off the main thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = [
    "Time",
    "TimeUnit",
    "Timestamp",
    "ensure_time",
    "Event",
    "State",
    "Algorithm",
    "Callback",
    "Engine",
    "Trace",
    "Trainer",
]


def _run(code: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_pulls_in_neither_ray_nor_fsspec_and_installs_no_signal_handlers():
    result = _run(
        """
        import json, signal, sys, atexit
        sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
        before = {int(s): repr(signal.getsignal(s)) for s in sigs}
        import torch  # torch registers its own atexit hooks; count only ours
        exits_before = atexit._ncallbacks()
        import raytrain_events
        after = {int(s): repr(signal.getsignal(s)) for s in sigs}
        roots = sorted({m.split(".")[0] for m in sys.modules})
        print(json.dumps({"before": before, "after": after, "roots": roots,
                          "new_atexit": atexit._ncallbacks() - exits_before,
                          "file": raytrain_events.__file__}))
        """
    )
    assert result["file"].startswith(str(ROOT))  # the checkout under test, not an installed copy
    assert result["before"] == result["after"]
    for heavy in ("ray", "fsspec", "s3fs", "pyarrow", "omegaconf", "torchmetrics"):
        assert heavy not in result["roots"], heavy
    assert result["new_atexit"] == 0


def test_ray_worker_entry_leaves_dcp_and_the_s3_clients_until_a_checkpoint_needs_them():
    """Every Ray worker imports the entry while its train context starts (the spec it unpickles);
    torch.distributed.checkpoint (~0.7 s here) is needed only for sharded checkpoints, and aiohttp and botocore
    (~0.5-1 s) only for S3: a save and a resume to a local folder through the loop leave them out (the checkpoint
    retries' and ranged reads' error lists take them from the modules already loaded: an error of a library never
    imported cannot exist)."""
    result = _run(
        """
        import json, sys, tempfile
        import torch
        import raytrain_events.ray.worker, raytrain_events.checkpoint.run.checkpointer
        from raytrain_events import Trainer
        from raytrain_events.checkpoint import CheckpointConfig
        from raytrain_events.models import ClassifierModel
        torch.manual_seed(0)
        rows = [{"x": torch.randn(4), "y": i % 2} for i in range(64)]
        model = ClassifierModel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
                                num_classes=2)
        folder = tempfile.mkdtemp()
        for duration in ("1ep", "2ep"):  # a save, then a resume that reads it back
            Trainer(model=model, train_dataloader=torch.utils.data.DataLoader(rows, batch_size=8),
                    max_duration=duration, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                    checkpoint=CheckpointConfig(save_folder=folder, save_interval="1ep", autoresume=True),
                    run_name="local").fit()
        clients = [m for m in ("aiohttp", "botocore", "s3fs") if m in sys.modules]
        before = sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint"))
        from raytrain_events.checkpoint.dcp import sharded
        sharded.load_consolidated  # the module itself still imports without DCP
        lazy = sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint"))
        import raytrain_events.checkpoint.dcp.safe_dcp
        print(json.dumps({"clients": clients, "before": before, "lazy": lazy,
                          "after": "torch.distributed.checkpoint" in sys.modules}))
        """
    )
    assert result["clients"] == []
    assert result["before"] == [] and result["lazy"] == []
    assert result["after"]  # the sharded path still gets it when it asks


def test_public_names_importable_from_top_level():
    result = _run(
        f"""
        import json
        from raytrain_events import {", ".join(PUBLIC)}
        import raytrain_events
        print(json.dumps({{"all": sorted(raytrain_events.__all__),
                           "missing": [n for n in {PUBLIC!r} if not hasattr(raytrain_events, n)]}}))
        """
    )
    assert result["missing"] == []
    assert set(PUBLIC) <= set(result["all"])


def test_public_names_are_the_core_objects():
    import raytrain_events
    from raytrain_events.core import algorithm, callback, engine, event, state, time
    from raytrain_events.trainer.trainer import Trainer

    assert raytrain_events.Time is time.Time and raytrain_events.TimeUnit is time.TimeUnit
    assert raytrain_events.Timestamp is time.Timestamp and raytrain_events.ensure_time is time.ensure_time
    assert raytrain_events.Event is event.Event and raytrain_events.State is state.State
    assert raytrain_events.Algorithm is algorithm.Algorithm and raytrain_events.Callback is callback.Callback
    assert raytrain_events.Engine is engine.Engine and raytrain_events.Trace is engine.Trace
    assert raytrain_events.Trainer is Trainer


def test_core_does_not_import_ray_or_fsspec():
    """core/ reads like the seed documents: no Ray, no storage."""
    import ast

    for path in (ROOT / "raytrain_events" / "core").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in {"ray", "fsspec", "s3fs"}, (path.name, name)


def test_the_modules_our_light_ray_actors_load_leave_torch_out():
    """The data feeder, block cutter, run history and Ray Data's dataset manager (which unpickles our
    `TrainDataConfig`) start in fresh processes at every fit and restart: torch's import (~2 s of
    CPU here) would be most of their start-up, and none of them runs a tensor."""
    result = _run(
        """
        import json, sys
        import raytrain_events
        import raytrain_events.data.ray.feeder, raytrain_events.ray.reports.history, raytrain_events.data.ray.loader
        import raytrain_events.data.ray.data_config
        import raytrain_events.data.ray.block_fetch, raytrain_events.data.ray.parquet_seek, raytrain_events.parallel.world
        light = "torch" in sys.modules
        raytrain_events.Trainer  # a public name still loads its module on first use
        print(json.dumps({"light": light, "after": "torch" in sys.modules}))
        """
    )
    assert result == {"light": False, "after": True}


def test_what_ray_trains_controller_unpickles_leaves_the_loop_out():
    """Ray Train's controller unpickles the run's context at every fit (ray/shipped.py): its callbacks
    (`AggregatingCallback`), the `RunSpec`'s module (for the validation entries) and the `Shipped` run. Before,
    `raytrain_events.trainer`'s eager `Trainer` and the spec's factories imported the loop, every algorithm and
    torch's DTensor there (0.7 s of CPU per fit, before its workers were asked for)."""
    result = _run(
        """
        import json, sys
        import raytrain_events.ray.reports.history, raytrain_events.ray.spec, raytrain_events.ray.shipped
        import raytrain_events.data.ray.data_config, raytrain_events.trainer.options
        heavy = ("raytrain_events.trainer.trainer", "raytrain_events.algorithms", "raytrain_events.callbacks",
                 "raytrain_events.checkpoint.run.checkpointer", "torch.distributed.tensor")
        print(json.dumps({"loaded": [m for m in heavy if m in sys.modules]}))
        """
    )
    assert result == {"loaded": []}


def test_the_run_reaches_the_workers_shipped(ray_cluster):
    """The driver puts the worker's run in the object store once; what Ray Train's controller unpickles is
    the reference alone (a few hundred bytes, whatever the spec holds), and a worker reads the run back whole."""
    import pickle

    import numpy as np

    from raytrain_events.ray.shipped import Shipped

    big = np.arange(1_000_000, dtype=np.int64)  # 8 MB the controller must not carry
    shipped = Shipped({"spec": (lambda x: x + 1), "plan": big})
    assert len(pickle.dumps({"run": shipped})) < 2_000
    run = pickle.loads(pickle.dumps(shipped)).get()
    assert run["spec"](1) == 2 and np.array_equal(run["plan"], big)


def test_every_public_name_of_the_lazy_packages_loads():
    """`__all__` stays literal (linters and IDEs read it); each name in it must be one `_LAZY` loads."""
    import importlib

    for package in ("raytrain_events", "raytrain_events.ray", "raytrain_events.parallel"):
        module = importlib.import_module(package)
        assert set(module.__all__) - {"__version__"} == set(module._LAZY), package
        for name in module.__all__:
            assert getattr(module, name) is not None, (package, name)


def test_the_run_spec_imports_nothing_of_the_checkpointing_package():
    """`RunSpec` (ray/spec.py, its sections and the ``validation`` option's module) defines and checks the
    options; running a validation or a checkpoint on Ray (``raytrain_events.ray.checkpointing``) uses the
    spec, never the other way (function-level imports count: they hide the edge, they do not remove it)."""
    import ast

    from tests.test_ownership_spec import spec_module_imports

    for rel in ("ray/spec.py", "ray/spec_sections.py", "ray/async_validation.py"):
        imported = spec_module_imports(ast.parse((ROOT / "raytrain_events" / rel).read_text()))
        assert not [m for m in imported if m.startswith("raytrain_events.ray.checkpointing")], (rel, imported)


def test_the_import_rule_catches_a_function_level_import():
    import ast

    from tests.test_ownership_spec import spec_module_imports

    tree = ast.parse("def f():\n    from raytrain_events.ray.checkpointing.validation import parse_validation\n")
    assert spec_module_imports(tree) == ["raytrain_events.ray.checkpointing.validation"]
