"""The ``raytrain-events`` command line: help texts, bad input (exit 2), and runs ls / inspect / diff.

Everything here runs in-process (``main(argv)``) except one subprocess check per entry point;
none of it starts Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from raytrain_events.cli.config import describe_keys
from raytrain_events.cli.entry import config_schema, load_entry
from raytrain_events.cli.main import build_parser, main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "train.py")
DigitsConfig = config_schema(load_entry(EXAMPLE + ":train_digits"))
CONFIG_KEYS = [key for key, _, _ in describe_keys(DigitsConfig)]


def run_main(argv, capsys):
    """``main(argv)`` -> (exit code, stdout, stderr); argparse's SystemExit becomes its code."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for child_name, child in _subparsers(sub):
                    yield f"{name} {child_name}", child


# ------------------------------------------------------------------------------ --help
@pytest.mark.parametrize("command", ["train", "runs", "runs ls", "inspect", "diff", "tokenize"])
def test_help_mentions_every_option(command, capsys):
    parser = dict(_subparsers(build_parser()))[command]
    code, out, _ = run_main(command.split() + ["--help"], capsys)
    assert code == 0
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in out, f"{command} --help does not mention {flag}"
        if not action.option_strings and action.metavar and action.help:
            assert str(action.metavar) in out
        if action.help and action.option_strings and action.dest != "help":
            assert action.help.split()[0] in out  # every option has an explanation
    if command == "train":
        for key in CONFIG_KEYS:
            assert f"  {key} (default: " in out, f"train --help does not describe config key {key}"


def test_top_level_help_lists_commands(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    for command in ("train", "runs", "inspect", "diff"):
        assert command in out


def test_entry_points_as_subprocesses():
    """``python -m raytrain_events`` and ``examples/train.py`` parse and print help (exit 0)."""
    env = dict(os.environ)
    for argv in ([sys.executable, "-m", "raytrain_events", "diff", "--help"], [sys.executable, EXAMPLE, "--help"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert "usage:" in proc.stdout
    assert "checkpoint.save_interval (default: 1ep)" in proc.stdout


# --------------------------------------------------------------------------- bad input
def test_unknown_config_key_lists_valid_keys(capsys):
    code, _, err = run_main(["train", "--print-config", "learning_rate=0.1"], capsys)
    assert code == 2
    assert "Unknown config key 'learning_rate'" in err
    for key in CONFIG_KEYS:
        assert key in err
    assert "Traceback" not in err


def test_unknown_nested_key_suggests_the_close_one(capsys):
    code, _, err = run_main(["train", "--print-config", "checkpoint.kep=3"], capsys)
    assert code == 2
    assert "'checkpoint.kep'" in err and "Did you mean 'checkpoint.keep'?" in err
    assert "checkpoint.save_interval" in err


def test_unknown_key_in_yaml_file(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("num_workers: 2\nbatchsize: 32\n")
    code, _, err = run_main(["train", "--print-config", "--config", str(path)], capsys)
    assert code == 2
    assert "'batchsize'" in err and str(path) in err and "batch_size" in err


def test_unknown_flag_lists_valid_options(capsys):
    code, _, err = run_main(["train", "--num-workers", "4"], capsys)
    assert code == 2
    assert "unrecognized arguments: --num-workers" in err
    assert "--config" in err and "--print-config" in err and "key=value" in err


@pytest.mark.parametrize(
    "override", ["max_duration=banana", "max_duration=10", "checkpoint.save_interval=soon", "warmup=xyz"]
)
def test_bad_duration_names_the_accepted_forms(override, capsys):
    code, _, err = run_main(["train", "--print-config", override], capsys)
    assert code == 2
    key = override.split("=")[0]
    assert f"{key}=" in err
    for unit in ("ep", "ba", "sp", "tok", "dur"):
        assert unit in err
    assert "like '5ep'" in err
    assert "Traceback" not in err


def test_fraction_of_run_is_refused_as_max_duration(capsys):
    code, _, err = run_main(["train", "--print-config", "max_duration=0.5dur"], capsys)
    assert code == 2 and "'ep', 'ba', 'sp' or 'tok'" in err


def test_bad_type_and_choice(capsys):
    code, _, err = run_main(["train", "--print-config", "num_workers=many"], capsys)
    assert code == 2 and "num_workers" in err and "int" in err
    code, _, err = run_main(["train", "--print-config", "model=resnet"], capsys)
    assert code == 2 and "mlp, cnn" in err


def test_unreachable_storage_names_uri_and_cause(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    storage = str(blocker / "runs")
    code, _, err = run_main(["train", f"storage={storage}", "run_name=r1"], capsys)
    assert code == 2
    assert storage in err
    assert "Not a directory" in err or "NotADirectoryError" in err
    assert "Traceback" not in err


def test_missing_backend_names_the_extra(capsys):
    pytest.importorskip("raytrain_events")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    code, _, err = run_main(["train", "storage=gs://bucket/runs", "run_name=r1"], capsys)
    assert code == 2 and "raytrain_events[gcs]" in err


def test_print_config_merges_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("num_workers: 3\nlr: 0.5\ncheckpoint:\n  keep: 5\n")
    code, out, _ = run_main(
        [
            "train",
            "--print-config",
            "--config",
            str(path),
            "lr=0.25",
            "algorithms=[label_smoothing, {name: mixup, alpha: 0.2}]",
        ],
        capsys,
    )
    assert code == 0
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(out)
    assert (
        cfg.num_workers == 3 and cfg.lr == 0.25 and cfg.checkpoint.keep == 5 and cfg.checkpoint.save_interval == "1ep"
    )
    assert OmegaConf.to_container(cfg.algorithms) == ["label_smoothing", {"name": "mixup", "alpha": 0.2}]


def test_example_yaml_matches_the_schema_defaults():
    """examples/configs/digits.yaml documents the defaults: loading it changes nothing."""
    from omegaconf import OmegaConf

    from raytrain_events.cli.config import load_config

    from_file = load_config(DigitsConfig, config_path=os.path.join(REPO, "examples", "configs", "digits.yaml"))
    assert OmegaConf.to_container(from_file) == OmegaConf.to_container(OmegaConf.structured(DigitsConfig))


# ---------------------------------------------------------------- runs ls / inspect / diff
def make_run(root, name, *, config, checkpoints=(), summary=None, storage_options=None):
    """A run directory as the digits job leaves it: config.yaml, checkpoints/, summary.json."""
    from raytrain_events.checkpoint.format.writer import write_checkpoint
    from raytrain_events.storage.exp_dir import RunDir
    from raytrain_events.storage.fs import join, resolve, write_bytes_atomic

    url = join(root, name)
    RunDir(url, storage_options or {}).save_config(config)
    for ts in checkpoints:
        write_checkpoint(
            join(url, "checkpoints"),
            files={"state.pt": {"w": torch.zeros(2)}},
            timestamp=ts,
            world_size=2,
            storage_options=storage_options,
        )
    if summary is not None:
        fs, path = resolve(join(url, "summary.json"), storage_options)
        write_bytes_atomic(fs, path, json.dumps(summary).encode())
    return url


def _ts(epoch, per_epoch=12, rows=1500):
    return {"epoch": epoch, "batch": per_epoch * epoch, "sample": rows * epoch, "token": 0}


def saved_config(job_config):
    """config.yaml as `RayTrainer.fit` saves it: the run's description, the job's config under ``config``."""
    return {
        "run_name": job_config["run_name"],
        "max_duration": job_config["max_duration"] or f"{job_config['epochs']}ep",
        "batch_size": job_config["batch_size"],
        "num_workers": job_config["num_workers"],
        "config": job_config,
    }


@pytest.fixture
def two_runs(tmp_path):
    from omegaconf import OmegaConf

    base = {**OmegaConf.to_container(OmegaConf.structured(DigitsConfig)), "lr": 0.1, "max_duration": "2ep"}
    root = str(tmp_path / "runs")
    a = make_run(
        root,
        "run-a",
        config=saved_config({**base, "run_name": "run-a"}),
        checkpoints=[_ts(1), _ts(2)],
        summary={
            "timestamp": _ts(2),
            "metrics": {"metrics/eval/accuracy": 0.93, "train/loss": 0.2},
            "wall_seconds": 40.0,
        },
    )
    b = make_run(
        root,
        "run-b",
        config=saved_config(
            {
                **base,
                "run_name": "run-b",
                "lr": 0.05,
                "max_duration": "3ep",
                "checkpoint": {**base["checkpoint"], "keep": 3},
                "algorithms": ["label_smoothing"],
            }
        ),
        checkpoints=[_ts(1)],
    )
    os.makedirs(os.path.join(root, "not-a-run"))
    return root, a, b


def test_runs_ls(two_runs, capsys):
    root, _, _ = two_runs
    code, out, _ = run_main(["runs", "ls", root], capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["RUN", "STATUS", "CHECKPOINTS"]
    assert (
        lines[1].split()[:3] == ["run-a", "finished", "2"]
        and "2ep 24ba 3000sp 0tok" in lines[1]
        and "0.9300" in lines[1]
    )
    assert lines[2].split()[:3] == ["run-b", "ended", "1"] and "1ep 12ba 1500sp 0tok" in lines[2]
    assert "not-a-run" not in out
    code, out, _ = run_main(["runs", "ls", root, "--json"], capsys)
    assert [r["name"] for r in json.loads(out)] == ["run-a", "run-b"]


def test_runs_ls_shows_a_running_run(two_runs, capsys):
    from raytrain_events.storage.locks import acquire_lock, release_lock

    root, _, b = two_runs
    lock = acquire_lock(b, "running")
    try:
        code, out, _ = run_main(["runs", "ls", root], capsys)
        assert code == 0 and out.splitlines()[2].split()[:2] == ["run-b", "running"]
        code, out, _ = run_main(["inspect", b], capsys)
        assert "status: running (host " in out and f"pid {os.getpid()}" in out
    finally:
        release_lock(b, "running", lock=lock)


def test_inspect_lists_checkpoints_with_timestamps_and_config(two_runs, capsys):
    _, a, _ = two_runs
    code, out, _ = run_main(["inspect", a], capsys)
    assert code == 0
    assert "checkpoints (2, oldest first)" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("ckpt-")]
    assert [r[1:5] for r in rows] == [["1", "12", "1500", "0"], ["2", "24", "3000", "0"]]
    assert "finished at 2ep 24ba 3000sp 0tok" in out and "metrics/eval/accuracy: 0.9300" in out
    assert "run_name: run-a" in out and "save_interval: 1ep" in out and "lr: 0.1" in out
    code, out, _ = run_main(["inspect", a, "--json"], capsys)
    info = json.loads(out)
    assert [c["timestamp"] for c in info["checkpoints"]] == [_ts(1), _ts(2)]
    assert info["config"]["run_name"] == "run-a"


def test_inspect_missing_run_is_a_clean_error(tmp_path, capsys):
    code, _, err = run_main(["inspect", str(tmp_path / "nope")], capsys)
    assert code == 2 and "No run at" in err and "runs ls" in err


def test_diff_line_by_line(two_runs, capsys):
    _, a, b = two_runs
    code, out, _ = run_main(["diff", a, b], capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines == [
        "- run_name: run-a",
        "+ run_name: run-b",
        "- max_duration: 2ep",
        "+ max_duration: 3ep",
        "- config.run_name: run-a",
        "+ config.run_name: run-b",
        "- config.max_duration: 2ep",
        "+ config.max_duration: 3ep",
        "- config.lr: 0.1",
        "+ config.lr: 0.05",
        "+ config.algorithms.0: label_smoothing",
        "- config.checkpoint.keep: 2",
        "+ config.checkpoint.keep: 3",
    ]
    code, _, _ = run_main(["diff", a, b, "--exit-code"], capsys)
    assert code == 1
    code, out, _ = run_main(["diff", a, a, "--exit-code"], capsys)
    assert code == 0 and "No differences" in out


def test_diff_needs_configs(two_runs, tmp_path, capsys):
    _, a, _ = two_runs
    code, _, err = run_main(["diff", a, str(tmp_path)], capsys)
    assert code == 2 and "No config.yaml" in err


def test_inspect_and_ls_on_s3(s3_server, capsys):
    from omegaconf import OmegaConf

    options = s3_server["storage_options"]
    root = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    url = make_run(
        root,
        "s3-run",
        config=saved_config({**OmegaConf.to_container(OmegaConf.structured(DigitsConfig)), "run_name": "s3-run"}),
        checkpoints=[_ts(1)],
        storage_options=options,
    )
    flags = [
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
        "-o",
        f"client_kwargs.endpoint_url={s3_server['endpoint']}",
        "-o",
        "client_kwargs.region_name=us-east-1",
    ]
    code, out, err = run_main(["inspect", url, "--json"] + flags, capsys)
    assert code == 0, err
    assert json.loads(out)["checkpoints"][0]["timestamp"] == _ts(1)
    code, out, err = run_main(["runs", "ls", root] + flags, capsys)
    assert code == 0 and "s3-run" in out, err


# ------------------------------------------------------------------ train ENTRY (module:function, file.py:function)
JOB_MODULE = '''
from dataclasses import dataclass, field

CALLS = []


@dataclass
class JobConfig:
    lr: float = field(default=0.1, metadata={"help": "Learning rate of this job."})
    steps: int = 3


def train(cfg: JobConfig):
    """A test job: records the config it was called with."""
    CALLS.append(dict(cfg))
    return 0


def no_config():
    CALLS.append("bare")


def untyped(cfg):
    pass


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def job_module(tmp_path, monkeypatch):
    name = f"job_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(JOB_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, tmp_path / f"{name}.py"


def test_train_runs_a_module_function_with_its_schema(job_module, capsys):
    name, _ = job_module
    code, _, err = run_main(["train", f"{name}:train", "lr=0.5"], capsys)
    assert code == 0, err
    assert sys.modules[name].CALLS == [{"lr": 0.5, "steps": 3}]
    code, out, _ = run_main(["train", f"{name}:train", "--help"], capsys)
    assert code == 0
    assert "lr (default: 0.1)" in out and "Learning rate of this job." in out and "A test job" in out
    assert "num_workers (default" not in out  # the digits keys belong to the default entry only
    code, _, err = run_main(["train", f"{name}:train", "learning_rate=1"], capsys)
    assert code == 2 and "Unknown config key 'learning_rate'" in err and "lr, steps" in err


def test_train_runs_a_file_function_and_a_function_without_config(job_module, tmp_path, capsys):
    _, path = job_module
    code, out, err = run_main(["train", "--print-config", f"{path}:train", "steps=7"], capsys)
    assert code == 0, err
    assert "steps: 7" in out and "lr: 0.1" in out
    code, _, err = run_main(["train", f"{path}:no_config"], capsys)
    assert code == 0, err
    code, _, err = run_main(["train", f"{path}:no_config", "lr=1"], capsys)
    assert code == 2 and "takes no config" in err


@pytest.mark.parametrize(
    "entry, message",
    [
        ("no_such_module_xyz:train", "no module named 'no_such_module_xyz'"),
        ("{module}:missing", "has no 'missing'. Its functions: no_config, train, untyped"),
        ("{module}:NOT_A_FUNCTION", "is a int, not a function"),
        ("{module}:untyped", "annotate its first parameter with a dataclass"),
        ("does/not/exist.py:train", "no file"),
    ],
)
def test_bad_entry_points_are_usage_errors(entry, message, job_module, capsys):
    code, _, err = run_main(["train", entry.format(module=job_module[0]), "--print-config"], capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_default_entry_is_the_digits_job_from_any_directory(tmp_path, monkeypatch, capsys):
    """The default entry point (examples/train.py:train_digits) is found through the checkout, not the cwd."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["train", "--print-config", "num_workers=3"], capsys)
    assert code == 0, err
    assert "num_workers: 3" in out and "model: mlp" in out
    code, explicit, _ = run_main(["train", "examples/train.py:train_digits", "--print-config", "num_workers=3"], capsys)
    assert code == 0 and explicit == out


def test_example_runs_when_copied_alone(tmp_path):
    """`ray submit` copies only the script: its defaults and help come from itself and the installed package."""
    import shutil

    alone = tmp_path / "home"
    alone.mkdir()
    shutil.copy(EXAMPLE, alone / "train.py")
    for argv in (["--print-config", "num_workers=3"], ["--help"]):
        proc = subprocess.run(
            [sys.executable, str(alone / "train.py"), *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(tmp_path),
        )
        assert proc.returncode == 0, proc.stderr
    assert "checkpoint.save_interval (default: 1ep)" in proc.stdout
    proc = subprocess.run(
        [sys.executable, str(alone / "train.py"), "--print-config", "num_workers=3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(alone),
    )
    assert proc.returncode == 0 and "num_workers: 3" in proc.stdout and "storage: ./runs" in proc.stdout


@pytest.mark.ray
@pytest.mark.slow
def test_train_file_entry_point_on_ray_workers(ray_cluster, tmp_path, monkeypatch, capsys):
    """A file-loaded entry point's functions reach the Ray workers by value (they cannot import the file)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    storage = str(tmp_path / "runs")
    code, out, err = run_main(
        [
            "train",
            f"{EXAMPLE}:train_digits",
            "max_duration=1ep",
            "num_workers=1",  # one worker proves the functions travel by value; a second only costs ~7 CPU-s
            f"storage={storage}",
            "run_name=entry",
            "progress_bar=false",
            "checkpoint.enabled=false",
            "report=false",  # the report is checked on the examples' shared run; here it costs seconds
        ],
        capsys,
    )
    assert code == 0, out[-2000:] + err[-3000:]
    with open(os.path.join(storage, "entry", "summary.json")) as fh:
        summary = json.load(fh)
    assert summary["timestamp"]["sample"] == 1500 and summary["train_rows"] == 1500
