"""FileLogger, TensorBoardLogger, MLFlowLogger and WandBLogger."""

from __future__ import annotations

import json
import pickle
import struct
import sys
import types

import pytest
import torch
from library_helpers import loader, trainer

from raytrain_events import Logger, LoggerDestination
from raytrain_events.callbacks import LRMonitor
from raytrain_events.loggers import FileLogger, MLFlowLogger, TensorBoardLogger, WandBLogger


def test_all_subclass_logger_destination():
    for cls in (FileLogger, TensorBoardLogger, MLFlowLogger, WandBLogger):
        assert issubclass(cls, LoggerDestination)


def test_file_logger_writes_parseable_json_lines(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    file_logger = pickle.loads(pickle.dumps(FileLogger(str(path))))  # picklable before use
    t = trainer(
        max_duration="3ba",
        callbacks=[LRMonitor()],
        loggers=[file_logger],
        eval_dataloader=loader(n=8),
        eval_interval="3ba",
    )
    t.logger.log_hyperparameters({"lr": 0.1, "model": {"hidden": 8}})
    t.fit()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0] == {"hyperparameters": {"lr": 0.1, "model": {"hidden": 8}}}
    lrs = [r for r in records if "lr-SGD/group0" in r]
    assert [r["step"] for r in lrs] == [1, 2, 3] and all(r["lr-SGD/group0"] == pytest.approx(0.1) for r in lrs)
    evals = [r for r in records if "metrics/eval/accuracy" in r]
    assert len(evals) == 1 and evals[0]["step"] == 3 and 0.0 <= evals[0]["metrics/eval/accuracy"] <= 1.0
    # appends by default (a resumed run continues the file); non-scalars become lists
    again = FileLogger(str(path))
    Logger([again]).log_metrics({"vec": torch.tensor([1.0, 2.0])}, step=9)
    again.close()
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 9, "vec": [1.0, 2.0]}
    assert len(path.read_text().splitlines()) == len(records) + 1


def _read_tfevents(path):
    """Parse a TFRecord event file with tensorboardX's protobufs: yields Event messages."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        offset += 12  # length + its crc
        yield event_pb2.Event.FromString(data[offset : offset + length])
        offset += length + 4  # payload + its crc


def test_tensorboard_logger_writes_an_event_file(tmp_path):
    log_dir = tmp_path / "tb"
    trainer(max_duration="3ba", callbacks=[LRMonitor()], loggers=[TensorBoardLogger(str(log_dir))]).fit()
    files = list(log_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars = [(e.step, v.tag, v.simple_value) for e in _read_tfevents(files[0]) for v in e.summary.value]
    assert [(s, tag) for s, tag, _ in scalars] == [(1, "lr-SGD/group0"), (2, "lr-SGD/group0"), (3, "lr-SGD/group0")]
    assert all(v == pytest.approx(0.1) for _, _, v in scalars)


@pytest.mark.parametrize(
    "module, cls, hint",
    [
        ("tensorboardX", TensorBoardLogger, "pip install tensorboardX"),
        ("mlflow", MLFlowLogger, "raytrain_events[mlflow]"),
        ("wandb", WandBLogger, "raytrain_events[wandb]"),
    ],
)
def test_missing_package_error_names_the_install(monkeypatch, module, cls, hint):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=hint.replace("[", r"\[").replace("]", r"\]")):
        cls("x") if cls is TensorBoardLogger else cls()


def test_mlflow_logger_forwards_to_mlflow(monkeypatch):
    calls = []
    fake = types.ModuleType("mlflow")
    run = types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))
    fake.set_tracking_uri = lambda uri: calls.append(("uri", uri))
    fake.set_experiment = lambda name: calls.append(("experiment", name))
    fake.active_run = lambda: None
    fake.start_run = lambda run_name=None, tags=None: calls.append(("start", run_name)) or run
    fake.log_metrics = lambda metrics, step=None: calls.append(("metrics", metrics, step))
    fake.log_params = lambda params: calls.append(("params", params))
    fake.end_run = lambda: calls.append(("end",))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    dest = MLFlowLogger(experiment_name="exp", run_name="r", tracking_uri="file:/tmp/x")
    assert calls == []  # nothing starts at construction
    logger = Logger([dest])
    logger.log_hyperparameters({"opt": {"lr": 0.1}})
    logger.log_metrics({"loss": torch.tensor(2.0), "name": "skip-me"}, step=4)
    logger.close()
    assert calls == [
        ("uri", "file:/tmp/x"),
        ("experiment", "exp"),
        ("start", "r"),
        ("params", {"opt.lr": "0.1"}),
        ("metrics", {"loss": 2.0}, 4),
        ("end",),
    ]


def test_wandb_logger_forwards_to_wandb(monkeypatch):
    calls = []

    class Run:
        config = types.SimpleNamespace(update=lambda d, allow_val_change=False: calls.append(("config", d)))

        def log(self, metrics, step=None):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.run = None
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    dest = WandBLogger(project="p", name="n")
    dest = pickle.loads(pickle.dumps(dest))
    logger = Logger([dest])
    logger.log_metrics({"a": 1.0}, step=2)
    logger.close()
    assert calls == [("init", {"project": "p", "name": "n"}), ("log", {"a": 1.0}, 2), ("finish",)]
