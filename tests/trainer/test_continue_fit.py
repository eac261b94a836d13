"""`fit(duration=...)` continues a fitted Trainer, `reset_time` starts the Timestamp over, and
`CheckpointConfig(load_ignore_keys=...)` loads part of a checkpoint (a new head)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.folder.store import list_checkpoints
from raytrain_events.core.state import CheckpointMismatchError
from raytrain_events.loggers import FileLogger

N, D = 48, 5


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Net(torch.nn.Module):
    def __init__(self, classes=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(D, 8)
        self.head = torch.nn.Linear(8, classes)

    def forward(self, batch):
        return self.head(torch.relu(self.body(batch[0])))

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch[1])


class Steps(Callback):
    def __init__(self):
        self.fit_starts, self.batches = 0, []

    def fit_start(self, state, logger):
        self.fit_starts += 1

    def batch_end(self, state, logger):
        self.batches.append(state.step)


def make(model, duration="2ep", **kw):
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data(), batch_size=8),  # 6 batches per epoch, no shuffle
        max_duration=duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        **kw,
    )


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fit_duration_continues_exactly_like_one_longer_fit(tmp_path):
    steps, log = Steps(), tmp_path / "log.jsonl"
    trainer = make(Net(), "2ep", callbacks=[steps], loggers=[FileLogger(str(log), mode="w")])
    trainer.fit()
    trainer.logger.log_metrics({"first": 1})  # closed after fit: reopened lazily
    state = trainer.fit(duration="1ep")
    assert state.timestamp.get_value("ep") == 3 and state.max_duration.to_timestring() == "3ep"
    assert steps.fit_starts == 2 and steps.batches == list(range(1, 19))
    trainer.fit(duration="4ba")  # a different unit: 4 more batches (into epoch 4)
    assert trainer.state.step == 22 and steps.batches[-1] == 22
    one = make(Net(), "3ep")
    one.fit()
    two = make(Net(), "2ep")
    two.fit()
    two.fit(duration=1)  # an int is epochs
    for name, value in weights(one.state.model).items():
        assert torch.equal(weights(two.state.model)[name], value), name
    lines = log.read_text().splitlines()
    assert any(json.loads(line).get("first") == 1 for line in lines)  # mode="w" did not truncate on reopen


def test_a_second_fit_without_duration_says_how():
    trainer = make(Net(), "1ep")
    trainer.fit()
    with pytest.raises(RuntimeError, match=r"fit\(duration='1ep'\)"):
        trainer.fit()
    with pytest.raises(ValueError, match=r"fit\(duration\)=.0.5dur. is a fraction of the run"):
        trainer.fit(duration="0.5dur")


def test_reset_time_starts_the_timestamp_over():
    steps = Steps()
    trainer = make(Net(), "1ep", callbacks=[steps])
    trainer.fit()
    trainer.fit(duration="3ba", reset_time=True)
    assert trainer.state.step == 3 and trainer.state.max_duration.to_timestring() == "3ba"
    assert steps.batches == [1, 2, 3, 4, 5, 6, 1, 2, 3]


def test_options_say_what_a_further_fit_trains_to():
    """`Trainer.options.max_duration` follows ``fit(duration=)`` (it used to stay at the first fit's
    length); the options object the caller passed is not changed."""
    from raytrain_events.trainer.options import LoopOptions

    given, model = LoopOptions(max_duration="1ep"), Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model=model, train_dataloader=DataLoader(data(), batch_size=8), optimizers=optimizer, options=given
    )
    trainer.fit()
    trainer.fit(duration="4ba")
    # 6 batches of epoch 1, then 4 more
    assert trainer.options.max_duration.to_timestring() == trainer.state.max_duration.to_timestring() == "10ba"
    trainer.fit(duration="2ba", reset_time=True)
    assert trainer.options.max_duration.to_timestring() == "2ba"
    assert given.max_duration.to_timestring() == "1ep"


def test_continued_fit_saves_checkpoints_again(tmp_path):
    folder = str(tmp_path / "run" / "checkpoints")
    config = CheckpointConfig(save_folder=folder, save_every_n_seconds=None, save_final=True)
    trainer = make(Net(), "1ep", checkpoint=config)
    trainer.fit()
    trainer.fit(duration="1ep")
    saved = [info.timestamp["epoch"] for info in list_checkpoints(folder)]
    assert saved == [1, 2]


def test_load_ignore_keys_loads_the_body_into_a_new_head(tmp_path):
    folder = str(tmp_path / "pre" / "checkpoints")
    pretrained = make(Net(classes=2), "1ep", checkpoint=CheckpointConfig(save_folder=folder, save_every_n_seconds=None))
    pretrained.fit()
    body = weights(pretrained.state.model)

    def finetune(**load):
        model = Net(classes=5, seed=3)
        head = weights(model)
        config = CheckpointConfig(save_folder=str(tmp_path / "ft" / "checkpoints"), load_from=folder, **load)
        return make(model, "1ep", checkpoint=config), head

    with pytest.raises(CheckpointMismatchError, match="head.weight"):
        finetune()  # a 5-class head cannot take the 2-class weights
    trainer, head = finetune(load_ignore_keys=["model/head.*", "optimizers"])
    loaded = weights(trainer.state.model)
    assert torch.equal(loaded["body.weight"], body["body.weight"]) and torch.equal(
        loaded["body.bias"], body["body.bias"]
    )
    assert torch.equal(loaded["head.weight"], head["head.weight"])  # the new head keeps its own init
    assert trainer.state.timestamp.get_value("ep") == 1  # timestamp not ignored: loaded
    trainer.fit(duration="1ep")
    with pytest.raises(ValueError, match=r"\['model/haed\.\*'\] match no checkpoint entry"):
        finetune(load_ignore_keys=["model/haed.*", "optimizers"])
    fresh, _ = finetune(load_ignore_keys=["model/head.*", "optimizers", "timestamp"])
    assert fresh.state.timestamp.get_value("ba") == 0


class EvalAt(Callback):
    def __init__(self):
        self.at = []

    def eval_end(self, state, logger):
        self.at.append((state.timestamp.get_value("ep"), state.timestamp.get_value("ba")))


def test_dur_eval_interval_follows_the_duration_of_a_further_fit():
    """'0.5dur' is half of the current max_duration: after fit(duration=...) it is half the new one.

    2ep then 2ep more (max_duration 4ep): evaluation every 1ep in the first fit, every 2ep in the
    second (as the Ray reporter's report_interval does), not every 1ep as resolved at construction.
    (A checkpoint's save_interval cannot be given in 'dur': `CheckpointConfig` refuses it.)
    """
    evals = EvalAt()
    loader = DataLoader(data(), batch_size=16)
    trainer = make(Net(), "2ep", eval_dataloader=loader, eval_interval="0.5dur", callbacks=[evals])
    trainer.fit()
    assert evals.at == [(1, 6), (2, 12)]
    trainer.fit(duration="2ep")
    assert evals.at[2:] == [(4, 24)]
    trainer.fit(duration="8ba")  # another unit: half of (24 + 8 = 32ba) is every 16 batches
    assert evals.at[3:] == [(5, 32)]
    with pytest.raises(ValueError, match="save_interval='0.5dur'"):
        CheckpointConfig(save_interval="0.5dur")
