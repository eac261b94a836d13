"""RayTrainer(parallelism=FSDPConfig(tensor_parallel=2)): the two workers of one tensor group are
fed the same batches by the global-order feeder, and the run counts every row once.

One Ray run (2 workers, the transformer LM example's model, one epoch plus an eval pass) proves:
TP was applied (parameters are DTensors on a mesh with a "tensor" dimension); both ranks trained
identical batches (row ids and the model's input tensors) and evaluated identical batches; the
counting rank of the group trained every row exactly once, in order; and the global Timestamp
(samples, tokens, batches) equals the dataset's exactly (one rank per group counts).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events import Callback

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]  # 280 s at load 6-58 here
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship this module's helpers to workers

ROWS, EVAL_ROWS, LENGTH, VOCAB = 90, 20, 16, 64
BATCH = 8  # rows per worker per batch: one data-parallel part, so 8 rows per global batch
BATCHES = 12  # 90 = 11 * 8 + 2: the short tail (2 rows >= 1 part) is a batch of its own


def make_rows(n: int, first_id: int = 0, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, LENGTH)).astype(np.int64)
    ntok = rng.integers(1, LENGTH + 1, size=n)  # tokens per row, varied so that a double count shows
    return [{"id": first_id + i, "input_ids": ids[i], "ntok": int(ntok[i])} for i in range(n)]


def make_model():
    import torch

    from examples.transformer_lm import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab=VOCAB, width=32, heads=4, depth=2, length=LENGTH)


def make_adam(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def count_tokens(batch) -> int:
    return int(batch["ntok"].sum())


def _digest(batch) -> str:
    return hashlib.sha256(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()


class RecordBatches(Callback):
    """Each rank writes, per train and eval batch, its row ids and a digest of the model's input,
    and at the end whether its parameters were split over a "tensor" mesh dimension."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_start(self, state, logger) -> None:
        self.file = open(os.path.join(self.folder, f"rank{state.rank}.jsonl"), "w")

    def _write(self, kind: str, state) -> None:
        record = {
            "kind": kind,
            "batch": state.timestamp.batch.value,
            "ids": [int(i) for i in state.batch["id"].tolist()],
            "digest": _digest(state.batch),
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def batch_end(self, state, logger) -> None:
        self._write("train", state)

    def eval_batch_end(self, state, logger) -> None:
        self._write("eval", state)

    def fit_end(self, state, logger) -> None:
        meshes = {
            tuple(p.device_mesh.mesh_dim_names or ()) for p in state.model.parameters() if hasattr(p, "device_mesh")
        }
        self.file.write(json.dumps({"kind": "end", "meshes": sorted(meshes), "counts": state.rank % 2 == 0}) + "\n")
        self.file.close()


def _read(folder, rank: int) -> list:
    with open(os.path.join(folder, f"rank{rank}.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_tensor_group_trains_the_same_batches_and_every_row_once(ray_cluster, tmp_path) -> None:
    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.parallel import FSDPConfig

    train, held_out = make_rows(ROWS), make_rows(EVAL_ROWS, first_id=1000, seed=1)
    folder = tmp_path / "records"
    folder.mkdir()
    result = RayTrainer(
        model=make_model,
        optimizers=make_adam,
        datasets={"train": ray.data.from_items(train), "val": ray.data.from_items(held_out)},
        max_duration="1ep",
        batch_size=BATCH,
        num_workers=2,
        parallelism=FSDPConfig(shard_modules=["Block"], tensor_parallel=2),
        get_num_tokens_in_batch=count_tokens,
        storage_path=str(tmp_path / "runs"),
        run_name="tp",
        callbacks=lambda: [RecordBatches(str(folder))],
        seed=0,
    ).fit()

    assert {
        "epoch": result.timestamp.get_value("ep"),
        "batch": result.timestamp.get_value("ba"),
        "sample": result.timestamp.get_value("sp"),
        "token": result.timestamp.get_value("tok"),
    } == {"epoch": 1, "batch": BATCHES, "sample": ROWS, "token": sum(r["ntok"] for r in train)}

    ranks = [_read(folder, 0), _read(folder, 1)]
    for records in ranks:
        end = records[-1]
        assert end["kind"] == "end" and ["shard", "tensor"] in end["meshes"], end  # TP applied, on a 2-D mesh
    trained = [[r for r in records if r["kind"] == "train"] for records in ranks]
    evaluated = [[r for r in records if r["kind"] == "eval"] for records in ranks]
    assert trained[0] == trained[1], "the two ranks of the tensor group trained different batches"
    assert evaluated[0] == evaluated[1], "the two ranks of the tensor group evaluated different batches"
    # The counting rank (rank 0) of the only group: every row once, in the global order, 12 batches.
    assert [r["batch"] for r in trained[0]] == list(range(1, BATCHES + 1))
    assert [i for r in trained[0] for i in r["ids"]] == list(range(ROWS))
    assert sorted(i for r in evaluated[0] for i in r["ids"]) == list(range(1000, 1000 + EVAL_ROWS))
