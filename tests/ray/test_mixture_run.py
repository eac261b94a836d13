"""`RayTrainer(mixture=...)` end to end: a 3-source mixture with a stage change, stopped mid-stage on 2
workers and resumed on 3 (issue 37's done-when).

Sources (tests/ray/test_mixture_ray.py's: ids 0-399, 1000-1149, 2000-2089 in 2 Parquet files each,
row groups of 10 rows) mixed '0dur': 0.5/0.3/0.2, '0.5dur': 0.2/0.3/0.5 over a 1-epoch run of 640
samples in global batches of 24 (27 batches; 'math' is asked for 212 rows of its 90, so it goes
round twice more). ``seed=None``: each source's order is its files' order, so the test names every
row the plan puts at every position. The first run stops itself after batch 18 (position 432, in
the second stage, a checkpoint there); the second continues the run by name on 3 workers, its
sources logging each file their read tasks open. Checked: the stop's and the end's exact
Timestamps; every global batch holds exactly the plan's rows (each source's rows once per pass), on
2 workers up to batch 18 and on 3 after; the per-source samples and tokens in the driver's final
history entry and in the run report's "Tokens seen per source" table are the plan's (the counts an
uninterrupted run makes: tests/ray/test_mixture_ray.py checks the loaders' counts against the plan
over a whole epoch); and the resumed run opened no file before any source's cursor.

Why a run pair of its own: the other RayTrainer flows (test_resume.py, test_parquet_seek.py) train
one train set and check that set's order; a mixture replaces the train set itself.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
from pyarrow import fs as pafs
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resume_helpers as h  # noqa: E402
from test_mixture_ray import SOURCES, CountingHandler, write_sources  # noqa: E402

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray_cloudpickle.register_pickle_by_value(h)

EPOCH, BATCH, STOP = 640, 24, 18  # 27 global batches: 26 of 24 rows and one of 16
STAGES = {"0dur": {"web": 0.5, "code": 0.3, "math": 0.2}, "0.5dur": {"web": 0.2, "code": 0.3, "math": 0.5}}


class Record(Callback):
    """Each rank appends ``{world, rank, batch, ids}`` per batch; the first run stops itself after batch ``stop``."""

    def __init__(self, folder: str, stop: int = 0) -> None:
        self.folder, self.stop = folder, stop

    def batch_end(self, state, logger) -> None:
        record = {
            "world": state.world_size,
            "rank": state.rank,
            "batch": int(state.timestamp.batch_in_epoch),
            "ids": [int(i) for i in state.batch["id"].tolist()],
        }
        with open(os.path.join(self.folder, f"rows-{os.getpid()}-{state.rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.stop and int(state.timestamp.batch) == self.stop:
            state.stop_training("the test's stop", consistent=True)


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


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two Ray runs; minutes each on a loaded machine
def test_a_mixture_stopped_mid_stage_on_2_workers_resumes_on_3_exactly(ray_cluster, tmp_path) -> None:
    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from raytrain_events.report import write_report

    paths = write_sources(str(tmp_path / "data"))
    records, logs = str(tmp_path / "records"), str(tmp_path / "logs")
    os.makedirs(records), os.makedirs(logs)
    mixture = Mixture(sources={n: rows for n, (_, rows) in SOURCES.items()}, stages=STAGES)
    checkpoint = CheckpointConfig(save_interval="9ba", keep=1, save_every_n_seconds=None, autoresume=True)
    results = []
    for attempt, workers in enumerate((2, 3)):
        log = os.path.join(logs, f"opened-{attempt}.log")
        fs = pafs.PyFileSystem(CountingHandler(log))
        datasets = {name: ParquetRowGroups(p, filesystem=fs) for name, p in paths.items()}
        os.remove(log)  # the footers, read here: not the run's reads
        results.append(
            RayTrainer(
                model=_model,
                optimizers=h.make_sgd,
                datasets=datasets,
                mixture=mixture.to_dict() if attempt else mixture,  # a Mixture or its dict
                batch_size=999,  # ignored: global_batch_size fixes the rows per step
                global_batch_size=BATCH,
                get_num_tokens_in_batch=h.count_tokens,
                max_duration="1ep",
                seed=None,  # each source in its files' order (a seed permutes each source's row groups)
                num_workers=workers,
                storage_path=str(tmp_path / "runs"),
                run_name="mix",
                checkpoint=checkpoint,
                report_interval="9ba",
                callbacks=[Record(records, stop=STOP if attempt == 0 else 0)],
            ).fit()
        )
    plan = mixture.plan(seed=0, total_samples=EPOCH, global_batch=BATCH)
    names = plan.mixture.names
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
    # Every global batch holds the plan's rows at its positions, in rank order, on 2 workers then on 3.
    by_batch = {}
    for path in os.listdir(records):
        with open(os.path.join(records, path)) as f:
            for line in f:
                r = json.loads(line)
                by_batch.setdefault(r["batch"], []).append(r)
    assert sorted(by_batch) == list(range(1, 28))
    for b, rs in by_batch.items():
        assert {r["world"] for r in rs} == {2 if b <= STOP else 3} and len(rs) == rs[0]["world"], b
        ids = [i for r in sorted(rs, key=lambda r: r["rank"]) for i in r["ids"]]
        assert ids == expected[(b - 1) * BATCH : b * BATCH], b
    # Per source: the plan's samples, and the tokens of its rows, in the final history entry and the report.
    totals = dict(zip(names, plan.epoch_totals(0)))
    final = results[1].metrics
    per_source = {n: (final[f"mixture/samples/{n}"], final[f"mixture/tokens/{n}"]) for n in names}
    assert per_source == {
        n: (totals[n], sum(ntok[i] for i in expected if first <= i < first + rows))
        for n, (first, rows) in SOURCES.items()
    }
    assert totals["math"] > 2 * SOURCES["math"][1]  # math went round: its rows once per pass (checked above)
    write_report(results[1].run_url)
    with open(os.path.join(results[1].run_url, "report.html")) as f:
        section = f.read().split("<h2>Tokens seen per source</h2>", 1)[1].split("<h2>", 1)[0]
    assert all(f">{n}<" in section and f">{totals[n]}<" in section for n in names), section
    # The resumed run read nothing before any source's cursor: per pass, the files from the cursor's on.
    opened = Counter()
    with open(os.path.join(logs, "opened-1.log")) as f:
        for line in f:
            path, pid = line.split()
            if int(pid) != os.getpid():
                opened[(os.path.basename(os.path.dirname(path)), os.path.basename(path))] += 1
    want = Counter()
    for name, cursor in zip(names, plan.cursors(0, STOP * BATCH)):
        rows = SOURCES[name][1]
        for pass_ in range(cursor // rows, (totals[name] - 1) // rows + 1):
            start = cursor % rows if pass_ == cursor // rows else 0
            for part in range(start // (rows // 2), 2):
                want[(name, f"part-{part}.parquet")] += 1
    assert opened == want
