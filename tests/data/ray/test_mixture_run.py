"""`RayTrainer(mixture=...)` end to end: a 3-source mixture whose online policy changes the weights during the
run, stopped on 2 workers after a weight change and resumed on 3 (issue 37's and issue 52's done-when).

Sources (tests/data/ray/test_mixture_ray.py's: ids 0-399, 1000-1149, 2000-2089 in 2 Parquet files each,
row groups of 10 rows) mixed 0.5/0.3/0.2 with ``online={"policy": "exp3", ...}`` over a 1-epoch run of 640
samples in global batches of 24 (27 batches). Each source's rows are also an eval set (``<source>_eval``,
evaluated every 8 batches, split once per group: ``deterministic_split``; in memory, ``from_arrow``): the policy switches the weights
at batches 8, 16 and 24 (positions 192, 384, 576), each a switch stage the feeder's stream re-enters at.
The uninterrupted run's history from the same eval losses is the policy's chain of decisions over them
from the first weights (computed here: `next_weights`, the policy's state carried across the resume).
``seed=None``: each source's order is its files' order, so the test names every row the final mixture's
plan puts at every position. The first run stops itself after batch 18 (position 432, two switches in, a
checkpoint there); the second continues the run by name on 3 workers, replays the checkpoint's history
(its first request names the switched mixture, so the driver's early stream of the base mixture is
dropped) and switches once more. Checked: the weights history (positions, batches, old and new weights,
losses) and the weights each batch trained with, as the uninterrupted run's; the stop's and the end's
exact Timestamps; every global batch holds exactly the final mixture's plan's rows (each source's rows
once per pass), on 2 workers up to batch 18 and on 3 after (so the feeder followed every switch, the
resume's included); the per-source samples and tokens in the driver's final history entry and in the run
report's "Tokens seen per source" table are that plan's; the run's checkpoint holds the history, which the
report's "Mixture weights over time" section lists.
(That a resumed stream opens no file before any source's cursor is tests/data/ray/test_mixture_ray.py's check.)

Why a run pair of its own: the other RayTrainer flows (test_resume.py, test_parquet_seek.py) train
one train set and check that set's order; a mixture replaces the train set itself.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_mixture_ray import SOURCES, write_sources  # noqa: E402

from tests import resume_helpers as h  # noqa: E402

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray_cloudpickle.register_pickle_by_value(h)

EPOCH, BATCH, STOP, EVERY = 640, 24, 18, 8  # 27 global batches: 26 of 24 rows and one of 16; evals every 8
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}
ONLINE = {
    "policy": "exp3",
    "rate": 3.0,
    "metric": "cross_entropy",
    "evaluators": {n: f"{n}_eval" for n in SOURCES},
}


def _online(state):
    from raytrain_events.data.online_mixture import OnlineMixture

    (callback,) = [c for c in state.callbacks if isinstance(c, OnlineMixture)]
    return callback


class Record(Callback):
    """Each rank appends ``{world, rank, batch, ids, weights}`` per batch and, at fit end, its weights history;
    the first run stops itself after batch ``stop``."""

    def __init__(self, folder: str, stop: int = 0) -> None:
        self.folder, self.stop = folder, stop

    def batch_end(self, state, logger) -> None:
        record = {
            "world": state.world_size,
            "rank": state.rank,
            "batch": int(state.timestamp.batch_in_epoch),
            "ids": [int(i) for i in state.batch["id"].tolist()],
            "weights": _online(state).weights,  # those this batch trained with (a switch comes at the eval after)
        }
        with open(os.path.join(self.folder, f"rows-{os.getpid()}-{state.rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.stop and int(state.timestamp.batch) == self.stop:
            state.stop_training("the test's stop", consistent=True)

    def fit_end(self, state, logger) -> None:
        with open(os.path.join(self.folder, f"history-{state.world_size}-{state.rank}.json"), "w") as f:
            json.dump(_online(state).changes(), f)


def _model():
    import torch

    from raytrain_events.models import ClassifierModel

    class Net(torch.nn.Module):  # the token ids in, a class out: a tiny LM stand-in
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.EmbeddingBag(8, 4)
            self.out = torch.nn.Linear(4, 2)

        def forward(self, tokens):
            return self.out(self.embed(tokens.long()))

    torch.manual_seed(0)
    return ClassifierModel(Net(), num_classes=2, input_key="tokens", target_key="label")


def _chain(mixture, history):
    """The history an uninterrupted run makes from the same eval losses: the policy's decisions one after the
    other from the first stage's weights (its state, the log-weights, carried across the resume)."""
    from raytrain_events.core.mixture_online import OnlinePolicy, initial_logs, next_weights

    names = mixture.names
    policy = OnlinePolicy.from_dict(mixture.online, names)
    total = sum(WEIGHTS.values())
    old = [WEIGHTS[n] / total for n in names]
    logs, out = initial_logs([WEIGHTS[n] for n in names]), []
    for batch, change in zip(range(EVERY, EPOCH // BATCH + 1, EVERY), history):
        logs, new = next_weights(policy, logs, [change["losses"][n] for n in names])
        out.append((batch * BATCH, batch, old, list(new)))
        old = list(new)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two Ray runs; minutes each on a loaded machine
def test_an_online_mixture_stopped_after_a_switch_on_2_workers_resumes_on_3_exactly(ray_cluster, tmp_path) -> None:
    import pyarrow.parquet as pq
    import ray

    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.core.mixture_online import WeightsChange, apply_history
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from raytrain_events.report import write_report
    from raytrain_events.report.mixture_weights import saved_weights_history

    paths = write_sources(str(tmp_path / "data"))
    records = str(tmp_path / "records")
    os.makedirs(records)
    mixture = Mixture(sources={n: rows for n, (_, rows) in SOURCES.items()}, weights=WEIGHTS, online=ONLINE)
    checkpoint = CheckpointConfig(save_interval="9ba", keep=1, save_every_n_seconds=None, autoresume=True)
    results = []
    for attempt, workers in enumerate((2, 3)):
        datasets = {name: ParquetRowGroups(p) for name, p in paths.items()}
        # In memory (the same rows, in the files' order): Ray Train splits each eval set at every group's start
        # (``deterministic_split``), and splitting a Parquet read ran read tasks in new worker processes (3 sets:
        # 10-40 s before each group trained, on the loaded 2-core machine); reading eval sets is not checked here.
        evals = {f"{name}_eval": ray.data.from_arrow(pq.read_table(p)) for name, p in paths.items()}
        results.append(
            RayTrainer(
                model=_model,
                optimizers=h.make_sgd,
                datasets={**datasets, **evals},
                eval_options={name: {"eval_interval": f"{EVERY}ba"} for name in evals},
                mixture=mixture.to_dict() if attempt else mixture,  # a Mixture or its dict
                batch_size=999,  # ignored: global_batch_size fixes the rows per step
                global_batch_size=BATCH,
                get_num_tokens_in_batch=h.count_tokens,
                max_duration="1ep",
                seed=None,  # each source in its files' order (a seed permutes each source's row groups)
                deterministic_split=True,  # eval sets split once per worker group, not streamed at every eval
                num_workers=workers,
                storage_path=str(tmp_path / "runs"),
                run_name="mix",
                checkpoint=checkpoint,
                report_interval="9ba",
                callbacks=[Record(records, stop=STOP if attempt == 0 else 0)],
            ).fit()
        )
    names = mixture.names
    # The weights history: the stopped run's (2 switches) replayed and continued on 3
    # workers, every rank alike, as the uninterrupted run's.
    histories = {}
    for path in os.listdir(records):
        if path.startswith("history-"):
            with open(os.path.join(records, path)) as f:
                histories.setdefault(path.split("-")[1], []).append(json.load(f))
    assert sorted(histories) == ["2", "3"] and len(histories["2"]) == 2 and len(histories["3"]) == 3
    assert all(h_ == histories["2"][0] for h_ in histories["2"]) and all(
        h_ == histories["3"][0] for h_ in histories["3"]
    )
    stopped, history = histories["2"][0], histories["3"][0]
    assert len(stopped) == 2 and history[:2] == stopped and len(history) == 3
    want = _chain(mixture, history)
    got = [(c["position"], c["batch"], [c["old"][n] for n in names], [c["new"][n] for n in names]) for c in history]
    assert [g[:2] for g in got] == [w[:2] for w in want] == [(192, 8), (384, 16), (576, 24)]
    for (_, _, old, new), (_, _, want_old, want_new) in zip(got, want):
        assert old == pytest.approx(want_old, abs=1e-12) and new == pytest.approx(want_new, abs=1e-12)
        assert max(abs(a - b) for a, b in zip(old, new)) > 1e-3  # each decision moved the weights
    # The run's order: the mixture with the history's switch stages.
    final = apply_history(mixture, [WeightsChange.from_dict(c, names) for c in history])
    plan = final.plan(seed=0, total_samples=EPOCH, global_batch=BATCH)
    assert list(plan.starts) == [0, 192, 384, 576]
    # The row at each position: each global batch the plan's positions listed by source (unseeded: a
    # source's t-th row is its row t % rows, pass after pass).
    taken, expected = [0] * len(names), []
    for s in plan.batch_sources(0, 0, EPOCH, 0, BATCH):
        first, rows = SOURCES[names[s]]
        expected.append(first + taken[s] % rows)
        taken[s] += 1
    ntok = {i: i % 10 + 1 for i in expected}
    # The exact Timestamp at the stop and at the end.
    assert h.timestamp_of(results[0]) == {
        "epoch": 0,
        "batch": STOP,
        "sample": STOP * BATCH,
        "token": sum(ntok[i] for i in expected[: STOP * BATCH]),
    }
    assert h.timestamp_of(results[1]) == {
        "epoch": 1,
        "batch": 27,
        "sample": EPOCH,
        "token": sum(map(ntok.get, expected)),
    }
    # Every global batch holds the plan's rows at its positions, in rank order, on 2 workers then on 3, and
    # trained with the weights of the switches before it.
    by_batch = {}
    for path in os.listdir(records):
        if path.startswith("rows-"):
            with open(os.path.join(records, path)) as f:
                for line in f:
                    r = json.loads(line)
                    by_batch.setdefault(r["batch"], []).append(r)
    assert sorted(by_batch) == list(range(1, 28))
    start = [WEIGHTS[n] / sum(WEIGHTS.values()) for n in names]
    for b, rs in by_batch.items():
        assert {r["world"] for r in rs} == {2 if b <= STOP else 3} and len(rs) == rs[0]["world"], b
        ids = [i for r in sorted(rs, key=lambda r: r["rank"]) for i in r["ids"]]
        assert ids == expected[(b - 1) * BATCH : b * BATCH], b
        weights = ([start] + [new for _, at, _, new in got if at < b])[-1]
        assert all(r["weights"] == pytest.approx(weights, abs=1e-12) for r in rs), b
    # Per source: the plan's samples, and the tokens of its rows, in the final history entry and the report.
    totals = dict(zip(names, plan.epoch_totals(0)))
    assert totals != dict(zip(names, mixture.plan(seed=0, total_samples=EPOCH).epoch_totals(0)))  # switched
    last = results[1].metrics
    per_source = {n: (last[f"mixture/samples/{n}"], last[f"mixture/tokens/{n}"]) for n in names}
    assert per_source == {
        n: (totals[n], sum(ntok[i] for i in expected if first <= i < first + rows))
        for n, (first, rows) in SOURCES.items()
    }
    write_report(results[1].run_url)
    with open(os.path.join(results[1].run_url, "report.html")) as f:
        page = f.read()
    section = page.split("<h2>Tokens seen per source</h2>", 1)[1].split("<h2>", 1)[0]
    assert all(f">{n}<" in section and f">{totals[n]}<" in section for n in names), section
    # The run's checkpoint holds the history, which the report draws and lists (its weights over time).
    assert saved_weights_history(results[1].run_url, {}) == history
    weights = page.split("<h2>Mixture weights over time (online policy)</h2>", 1)[1].split("<h2>", 1)[0]
    assert all(f">{at}<" in weights for at, *_ in got), weights
