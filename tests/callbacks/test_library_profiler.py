"""`Profiler`: torch.profiler on a wait/warmup/active schedule; one Chrome trace per rank and cycle,
named by rank and batch, written locally or to S3 (moto) through the storage layer."""

from __future__ import annotations

import json
import os
import sys
import uuid

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Trainer
from raytrain_events.callbacks import Profiler
from raytrain_events.storage.fs import read_bytes, resolve

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
from gloo_ranks import run_ranks  # noqa: E402
from oom_ranks import train_profiled  # noqa: E402


def fit(profiler, batches=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * 4, 6, generator=g)
    net = _Net()
    Trainer(
        model=net,
        train_dataloader=DataLoader(TensorDataset(x, torch.randint(0, 3, (len(x),), generator=g)), batch_size=4),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        callbacks=[profiler],
    ).fit()


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, batch):
        return self.fc(batch[0])

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch[1])


def _trace(url, options=None):
    fs, path = resolve(url, options)
    return json.loads(read_bytes(fs, path))


def test_schedule_names_and_contents_local(tmp_path):
    folder = str(tmp_path / "profiler")
    profiler = Profiler(folder, wait="1ba", warmup=1, active="2ba", repeat=2)
    fit(profiler, batches=10)
    # Cycles of 1 wait + 1 warmup + 2 active batches: traces after batches 4 and 8, then no more.
    assert [u.rsplit("/", 1)[1] for u in profiler.traces] == [
        "rank0_batch4.pt.trace.json",
        "rank0_batch8.pt.trace.json",
    ]
    names = {e.get("name") for e in _trace(profiler.traces[0])["traceEvents"]}
    assert "aten::addmm" in names  # the Linear's forward was recorded
    steps = sorted(n for n in names if n and n.startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # only the active batches


def test_one_trace_per_rank_and_cycle_on_two_gloo_ranks(tmp_path):
    folder = tmp_path / "profiler"
    ranks = run_ranks(train_profiled, 2, folder=str(folder))
    for rank, result in enumerate(ranks):
        names = [u.rsplit("/", 1)[1] for u in result["traces"]]
        assert names == [f"rank{rank}_batch4.pt.trace.json", f"rank{rank}_batch8.pt.trace.json"]
        trace = _trace(result["traces"][0])
        assert trace["distributedInfo"]["rank"] == rank  # written by that rank's own profiler
        names_in_trace = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::addmm" in names_in_trace
        assert sorted(n for n in names_in_trace if n and n.startswith("ProfilerStep#")) == [
            "ProfilerStep#2",
            "ProfilerStep#3",
        ]
    assert sorted(os.listdir(folder)) == sorted(f"rank{r}_batch{b}.pt.trace.json" for r in (0, 1) for b in (4, 8))


def test_traces_go_to_s3(s3_server):
    options = s3_server["storage_options"]
    folder = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}/profiler"
    profiler = Profiler(folder, wait=0, warmup=1, active=1, repeat=1, storage_options=options)
    fit(profiler, batches=3)
    assert profiler.traces == [f"{folder}/rank0_batch2.pt.trace.json"]
    assert _trace(profiler.traces[0], options)["traceEvents"]


@pytest.mark.parametrize("bad", [dict(active=0), dict(wait="10sp"), dict(repeat=-1), dict(active="2tok")])
def test_bad_schedule(bad, tmp_path):
    with pytest.raises(ValueError, match="Profiler"):
        Profiler(str(tmp_path), **bad)
