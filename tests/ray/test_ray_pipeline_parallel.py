"""RayTrainer(parallelism=FSDPConfig(pipeline_parallel=2)): bad input refused before Ray starts, an
outermost pipeline's stages served one data part by the train config (8 ranks, no Train run), and one short
run (4 workers, one pipeline of 2 stages x 2 context ranks, ``pipeline_outermost``) through the feeder.

The run proves: each worker holds one stage (its parameters only: the first stage the embeddings,
the last the head), split over its 2 context ranks; all 4 ranks trained the same rows in the global
order (the feeder serves a pipeline's ``p x c`` ranks like a tensor group: the same part of each
batch); the global Timestamp counts every row and token once (not once per stage or context rank);
the loss the driver reports is the model's, the same on every rank, and the trained stages joined
are a one-process `Trainer`'s parameters on the same batches (CP's float tolerance).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

import numpy as np
import pytest
import torch
from bad_input_helpers import no_ray  # noqa: F401 -- the fixture, used by name
from bad_input_helpers import unread_dataset as _unread_dataset
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's helpers to workers

ROWS, LENGTH, VOCAB, BATCH = 40, 16, 64, 8


def make_model(meta: bool = True) -> Any:
    from examples.transformer_lm import TransformerLM, next_tokens

    class MeteredLM(TransformerLM):  # eval metrics: next-token cross-entropy
        def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
            from raytrain_events.metrics import CrossEntropy

            return {"cross_entropy": CrossEntropy()}

        def update_metric(self, batch: Any, outputs: torch.Tensor, metric: Any) -> None:
            metric.update(outputs[:, :-1].reshape(-1, VOCAB), next_tokens(batch)[:, :-1].reshape(-1))

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):  # each worker materialises its own stage only
        return MeteredLM(vocab=VOCAB, width=32, heads=4, depth=2, length=LENGTH)


def make_adam(model: Any) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def count_tokens(batch: Any) -> int:
    return int(batch["ntok"].sum())


class RecordStages(Callback):
    """Each rank writes its rows and loss per batch, and at the end the parameter names it holds."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_start(self, state: Any, logger: Any) -> None:
        self.file = open(os.path.join(self.folder, f"rank{state.rank}.jsonl"), "w")

    def batch_end(self, state: Any, logger: Any) -> None:
        record = {"ids": [int(i) for i in state.batch["id"].tolist()], "loss": float(state.loss)}
        self.file.write(json.dumps(record) + "\n")

    def eval_end(self, state: Any, logger: Any) -> None:
        record = {k: float(v) for k, v in logger.metrics.items() if k.startswith("metrics/")}
        self.file.write(json.dumps({"eval": record}) + "\n")

    def fit_end(self, state: Any, logger: Any) -> None:
        self.file.write(json.dumps({"params": sorted(n for n, _ in state.model.named_parameters())}) + "\n")
        self.file.close()
        held = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in state.model.named_parameters()}
        torch.save({n: p.detach().cpu() for n, p in held.items()}, os.path.join(self.folder, f"rank{state.rank}.pt"))


def _options(**over: Any) -> Dict[str, Any]:
    from raytrain_events.parallel import FSDPConfig

    options: Dict[str, Any] = dict(
        model=make_model,
        optimizers=make_adam,
        datasets={"train": _unread_dataset()},
        max_duration="1ep",
        batch_size=BATCH,
        num_workers=2,
        parallelism=FSDPConfig(pipeline_parallel=2, pipeline_microbatches=2),
        run_name="pp",
    )
    options.update(over)
    return options


@pytest.mark.parametrize(
    "over, error",
    [
        ({"num_workers": 3}, "pipeline_parallel=2\\) needs a world size divisible by 2.*got 3 ranks"),
        ({"algorithms": ["mixup"]}, "MixUp: it mixes the inputs on the first stage"),
        (
            {"parallelism": {"pipeline_parallel": 2, "pipeline_stages_per_rank": 2, "pipeline_schedule": "loopedbfs"}},
            "4 stages do not divide the model's 2 blocks evenly",
        ),
        ({"grad_accum": 2}, "grad_accum=2 with FSDPConfig\\(pipeline_parallel=2\\)"),
        (
            {"parallelism": {"pipeline_parallel": 2, "pipeline_outermost": True, "context_parallel": 2}},
            "pipeline_parallel=2, context_parallel=2\\) needs a world size divisible by 4, got 2 ranks",
        ),
    ],
)
def test_ray_trainer_refuses_bad_pipelines_before_ray_starts(tmp_path: Any, no_ray: Any, over: Any, error: str) -> None:  # noqa: F811
    from raytrain_events import RayTrainer

    if "datasets" in over:
        over = {"datasets": {name: _unread_dataset() for name in over["datasets"]}}
    with pytest.raises(ValueError, match=error):
        RayTrainer(**_options(storage_path=str(tmp_path), **over)).fit()


@pytest.mark.ray
def test_an_outermost_pipelines_ranks_are_served_one_data_parallel_part(ray_cluster: Any) -> None:
    """``pipeline_outermost`` on 8 ranks (PP 2 x DP 2 x TP 2, mesh (pipeline, shard, tensor)): a
    pipeline's stages are 4 ranks apart; `TrainDataConfig` (built as the driver builds it) serves
    each rank as `ParallelismSpec.serving_rank` maps it: every rank of a pipeline gets the shard of one
    data-parallel part (the feeder serves part ``rank // batch_group``, and the eval splits index
    their parts by the same mapping). No rows are pulled: a pull starts a Ray Data run, ~17 s here
    at load 30, for the feeder's own contract (its tests: tests/ray/test_ray_tensor_parallel.py)."""
    ray = ray_cluster
    from raytrain_events.data.order import GlobalBatch
    from raytrain_events.data.ray.data_config import TrainDataConfig
    from raytrain_events.parallel.config import parse_parallelism

    spec = parse_parallelism({"pipeline_parallel": 2, "tensor_parallel": 2, "pipeline_outermost": True})
    config = TrainDataConfig(
        batch=GlobalBatch(4, None, spec.batch_group),
        train_rows=32,
        tensor_parallel=spec.batch_group,
        serving_rank=spec.serving_rank,
    )
    out = config.configure({"train": ray.data.range(32)}, 8, None, None)  # eval sets use the same `served`
    served = [out[rank]["train"].rank for rank in range(8)]
    assert sorted(served) == list(range(8))  # every rank its own feeder cursor
    parts = [rank // spec.batch_group for rank in served]  # the feeder's part of each rank
    assert parts == [spec.data_coordinates(rank, 8)[0] for rank in range(8)] == [0, 0, 1, 1] * 2


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)  # 39 s at load 2-9, 49 s at load 8-18 here (2 cores); 2 workers took 27-30 s
def test_a_pipeline_of_context_pairs_over_four_workers_trains_every_row_once_like_one_process(
    ray_cluster: Any, tmp_path: Any
) -> None:
    """PP 2 x CP 2 on 4 workers, mesh (pipeline, shard 1, context): stages 0 and 1 on ranks 0-1 and
    2-3, each stage's attention split over its context pair."""
    import ray.data
    from torch.utils.data import DataLoader

    from raytrain_events import RayTrainer, Trainer
    from raytrain_events.parallel import FSDPConfig
    from tests.ray.test_ray_tensor_parallel import make_rows

    train, val = make_rows(ROWS), make_rows(12, seed=1)
    folder = tmp_path / "records"
    folder.mkdir()
    result = RayTrainer(
        **_options(
            datasets={"train": ray.data.from_items(train), "val": ray.data.from_items(val)},
            get_num_tokens_in_batch=count_tokens,
            storage_path=str(tmp_path / "runs"),
            callbacks=lambda: [RecordStages(str(folder))],
            num_workers=4,
            resources_per_worker={"CPU": 0.5},  # 4 workers and Ray Data beside them on the session's 4 CPUs
            # the pipeline outermost (torchtitan's order): with one pipeline the same ranks, through the
            # driver's serving_rank and the mesh (pipeline, shard, context) on the workers
            parallelism=FSDPConfig(
                pipeline_parallel=2, pipeline_microbatches=2, pipeline_outermost=True, context_parallel=2
            ),
        )
    ).fit()
    stamp = {unit: result.timestamp.get_value(unit) for unit in ("ep", "ba", "sp", "tok")}
    assert stamp == {"ep": 1, "ba": ROWS // BATCH, "sp": ROWS, "tok": sum(r["ntok"] for r in train)}
    ranks = []
    for rank in range(4):
        with open(folder / f"rank{rank}.jsonl") as fh:
            ranks.append([json.loads(line) for line in fh])
    held = [records[-1]["params"] for records in ranks]
    first, last = held[0], held[2]
    assert held == [first, first, last, last]  # a stage's context pair holds the stage
    assert "tokens.weight" in first and "head.weight" not in first and "blocks.0.attn.q.weight" in first
    assert "head.weight" in last and "tokens.weight" not in last and "blocks.1.attn.q.weight" in last
    # The eval set (at the epoch's end) ran the stages forward only, whole rows on every context rank:
    # the same metric on every rank.
    evals = [[r["eval"] for r in records if "eval" in r] for records in ranks]
    assert evals[1:] == [evals[0]] * 3 and len(evals[0]) == 1
    joined = {**torch.load(folder / "rank0.pt"), **torch.load(folder / "rank2.pt")}
    unsplit = make_model(meta=False)  # the trained stages joined into the whole model, evaluated on one process
    unsplit.load_state_dict(joined)
    metric = unsplit.get_metrics()["cross_entropy"]
    with torch.no_grad():
        ids = torch.tensor(np.stack([row["input_ids"] for row in val]))
        unsplit.update_metric({"input_ids": ids}, unsplit({"input_ids": ids}), metric)
    assert evals[0][0]["metrics/val/cross_entropy"] == pytest.approx(float(metric.compute()), abs=1e-5)
    batches = [[r for r in records[:-1] if "ids" in r] for records in ranks]
    assert [[r["ids"] for r in rank] for rank in batches[1:]] == [[r["ids"] for r in batches[0]]] * 3
    assert [i for r in batches[0] for i in r["ids"]] == list(range(ROWS))
    losses = [[r["loss"] for r in rank] for rank in batches]
    assert losses[1:] == [losses[0]] * 3  # the model's, on every stage and context rank
    # The reference: one process, the whole model, the same batches in 2 microbatches (the pipeline's).
    model = make_model(meta=False)
    reference = Trainer(
        model=model,
        train_dataloader=DataLoader(train, batch_size=BATCH),
        optimizers=make_adam(model),
        max_duration="1ep",
        grad_accum=2,
        callbacks=[RecordStages(str(tmp_path))],
    )
    reference.fit()
    with open(tmp_path / "rank0.jsonl") as fh:
        expected = [json.loads(line) for line in fh][:-1]
    assert losses[0] == pytest.approx([r["loss"] for r in expected], abs=1e-5)
    assert sorted(joined) == sorted(n for n, _ in model.named_parameters())
    for name, value in model.named_parameters():  # without CP's attention routing these differ by ~1e-2
        torch.testing.assert_close(joined[name], value.detach(), atol=2e-5, rtol=0, msg=name)
