"""Rank functions for the document-mask tests (importable by spawned ranks): the example transformer's
outputs on a packed batch, whole on one process, cut by context parallelism over a group, and
trained and predicted under pipeline parallelism against DDP."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Dict, List

import torch

SEQ, VOCAB = 16, 64


def packed_batch(change: bool = False) -> Dict[str, torch.Tensor]:
    """Two rows of packed documents (ids: row 0 = 10 | 11 | 12 | pad, row 1 = 20 | 21); ``change``
    alters one token of document 11 (row 0, position 7)."""
    docs = torch.tensor(
        [[10] * 5 + [11] * 4 + [12] * 5 + [-1] * 2, [20] * 9 + [21] * 7],
    )
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    index = torch.arange(SEQ).expand_as(docs)
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    if change:
        ids[0, 7] = (ids[0, 7] + 1) % VOCAB
    return {"input_ids": ids, "document_ids": docs, "position_ids": (index - first).masked_fill(docs < 0, 0)}


def as_cu_seqlens(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`packed_batch` in the cu_seqlens format (`PackedTokens(document_format="cu_seqlens")`): row 0 = 5 | 4 | 5 |
    pad 2, row 1 = 9 | 7, laid end to end."""
    cu = torch.tensor([0, 5, 9, 14, 16, 25, 32], dtype=torch.int32)
    out = {"input_ids": batch["input_ids"], "cu_seqlens": cu, "max_seqlen": torch.tensor(9, dtype=torch.int32)}
    return {**out, "num_tokens": torch.tensor([14, 16], dtype=torch.int32)}


def cu_seqlens_rows(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """A loader's collate: `packed_rows` as one ``cu_seqlens`` batch (each row's runs of a document id, its
    padding one run more, laid end to end), as `PackedTokens(document_format="cu_seqlens")` serves them."""
    lengths: List[int] = []
    for row in rows:
        docs = row["document_ids"]
        starts = torch.nonzero(torch.cat([torch.tensor([True]), docs[1:] != docs[:-1]])).flatten()
        lengths += torch.diff(starts, append=torch.tensor([len(docs)])).tolist()
    return {
        "input_ids": torch.stack([row["input_ids"] for row in rows]),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        "max_seqlen": torch.tensor(max(lengths), dtype=torch.int32),
        "num_tokens": torch.stack([row["num_tokens"] for row in rows]).to(torch.int32),
    }


def segment_rows(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """A loader's collate: `packed_rows` as the Ray train loader ships a ``document_ids`` batch
    (`packed_batch.packed_tensors(..., expand=False)`: ``input_ids``, each row's runs and padding as segments,
    ``num_tokens``), for the loader's ``device_transforms`` (`SegmentLoader`) to finish on the device."""
    import numpy as np

    from raytrain_events.core.segments import SEGMENT_COLUMNS, run_segments

    documents: List[int] = []
    lengths: List[int] = []
    runs: List[int] = []
    for row in rows:
        real = int(row["num_tokens"])
        starts = torch.nonzero(row["position_ids"][:real] == 0).flatten().tolist()  # each run's first token
        documents += [int(row["document_ids"][a]) for a in starts]
        lengths += torch.diff(torch.tensor([*starts, real])).tolist()
        runs.append(len(starts))
    num_tokens = np.array([int(row["num_tokens"]) for row in rows], dtype=np.int32)
    segments = run_segments(np.array(documents), np.array(lengths), np.array(runs), num_tokens, SEQ)
    return {
        "input_ids": torch.stack([row["input_ids"] for row in rows]),
        **{k: torch.from_numpy(v) for k, v in zip(SEGMENT_COLUMNS, segments)},
        "num_tokens": torch.from_numpy(num_tokens),
    }


def segment_loader(rows: List[Dict[str, torch.Tensor]], batch_size: int) -> Any:
    """A ``DataLoader`` of `segment_rows` batches that finishes them on the device as the Ray train loader does
    (its own ``device_transforms``, which `DataSpec` runs before the user's: `packed_batch.expand_batch`)."""
    from torch.utils.data import DataLoader

    from raytrain_events.data.ray.packed_batch import expand_batch

    class SegmentLoader(DataLoader):
        device_transforms = staticmethod(expand_batch)

    return SegmentLoader(rows, batch_size=batch_size, collate_fn=segment_rows)


def model() -> Any:
    from examples.transformer_lm import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab=VOCAB, width=32, heads=4, depth=2, length=SEQ)


def cp_logits(rank: int, world_size: int) -> Dict[str, Any]:
    """The logits of the packed batch (and of the changed one) under context parallelism over all ranks,
    gathered back into sequence order; and the loss of this rank's part."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raytrain_events.parallel.context_parallel import ContextParallel

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("shard", "context"))
    net = model()
    cp = ContextParallel(net, mesh, world_size)
    net.train()
    out: Dict[str, Any] = {}
    for name, change in (("base", False), ("changed", True), ("cu_seqlens", False)):
        batch = packed_batch(change)
        part = cp.split(as_cu_seqlens(batch) if name == "cu_seqlens" else batch)
        logits = net(part)
        pieces = [torch.empty_like(logits) for _ in range(world_size)]
        dist.all_gather(pieces, logits.detach().contiguous())
        where = [torch.empty_like(part["positions"]) for _ in range(world_size)]
        dist.all_gather(where, part["positions"])
        whole = torch.empty(logits.shape[0], SEQ, logits.shape[-1])
        for p, w in zip(pieces, where):
            whole[:, w] = p
        loss = net.loss(logits, part).detach()
        dist.all_reduce(loss)  # each rank's part divided by its share of the labels: summed, the whole loss
        out[name] = {"logits": whole, "loss": float(loss) / world_size}
    return out


def packed_rows(rows: int, seed: int) -> List[Dict[str, torch.Tensor]]:
    """``rows`` packed sequences of `SEQ` tokens (best fit of random documents of 1-12 tokens, padding included)."""
    import numpy as np

    from raytrain_events.core.packing import pack_window

    rng = np.random.default_rng(seed)
    out: List[Dict[str, torch.Tensor]] = []
    doc = 0
    while len(out) < rows:
        lengths = rng.integers(1, 13, size=24)
        tokens = rng.integers(1, VOCAB, size=int(lengths.sum())).astype(np.int64)
        packed = pack_window(tokens, lengths, np.arange(doc, doc + 24), SEQ, "best_fit")
        doc += 24
        for i in range(len(packed.num_tokens)):
            out.append(
                {
                    "input_ids": torch.from_numpy(packed.input_ids[i]),
                    "document_ids": torch.from_numpy(packed.document_ids[i]),
                    "position_ids": torch.from_numpy(packed.position_ids[i]),
                    "num_tokens": torch.tensor(int(packed.num_tokens[i])),
                }
            )
    return out[:rows]


def train_packed(rank: int, world_size: int, arms: Any, group: Dict[str, int]) -> Dict[str, Any]:
    """Each arm trains 4 batches of 8 packed rows (grad accumulation 2, real tokens counted) on shard
    ``rank // group``: its losses, first-batch gradients and Timestamp."""
    from torch.utils.data import DataLoader

    from raytrain_events import Trainer
    from raytrain_events.core.data_spec import DataSpec
    from tests.parallel.cp_workloads import CP_ARMS, Record

    out: Dict[str, Any] = {}
    for name in arms:
        record = Record()
        net = model()
        rows = packed_rows(32, seed=100 + rank // group[name])
        # CP x TP from the Ray train loader's batches (segments, finished on the device); DDP from expanded rows
        loader = segment_loader(rows, 8) if name == "cp_tp" else DataLoader(rows, batch_size=8)
        trainer = Trainer(
            model=net,
            train_dataloader=DataSpec(loader, get_num_tokens_in_batch=lambda b: int(b["num_tokens"].sum())),
            max_duration="4ba",
            optimizers=torch.optim.AdamW(net.parameters(), lr=2e-3),
            grad_accum=2,
            parallelism=CP_ARMS[name],
            callbacks=[record],
        )
        trainer.fit()
        out[name] = {"losses": record.losses, "grads": record.grads, "timestamp": trainer.state.timestamp.state_dict()}
        trainer.close()
    return out


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs")


def train_packed_pp(rank: int, world_size: int) -> Dict[str, Any]:
    """On 4 ranks: DDP (each data shard on 2 ranks: its mean gradient is the 2-shard one) and PP 2 x DP 2
    under each of `PP_SCHEDULES` (2 microbatches, a 4-block model built on the meta device) train 4
    batches of 8 packed rows; each arm's batch losses, this rank's full parameters (its stages' under
    PP), its Timestamp, and `Trainer.predict` of `packed_batch` and its changed copy (batches of 2 rows:
    one row per microbatch, each with its own documents) after training. ``1f1b_cu``: 1F1B on the same
    rows as ``cu_seqlens`` batches, with the number of conversions to document ids on this rank."""
    from torch.utils.data import DataLoader

    from examples.transformer_lm import TransformerLM
    from raytrain_events import Trainer
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.parallel import document_attention
    from raytrain_events.parallel.config import parse_parallelism
    from tests.parallel.pp_workloads import EventCounter, pp_config
    from tests.parallel.workloads import full_model_state

    def rows(batch: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
        return [{k: v[i] for k, v in batch.items()} for i in range(2)]

    out: Dict[str, Any] = {}
    convert = document_attention.cu_seqlens_to_ids
    conversions = [0]

    def counted(*args: Any) -> Any:
        conversions[0] += 1
        return convert(*args)

    document_attention.cu_seqlens_to_ids = counted  # type: ignore[assignment]  (this spawned rank's own module)
    for name in ("ddp", "ddp_one") + PP_SCHEDULES + ("1f1b_tp", "1f1b_cu"):
        # ddp_one: every rank loads shard 0 (the reference of PP 2 x TP 2, whose only data shard it is)
        parallelism: Any = {"1f1b_tp": pp_config("1f1b", tensor_parallel=2)}.get(name, "ddp")
        parallelism = pp_config(name) if name in PP_SCHEDULES else parallelism
        parallelism = pp_config("1f1b") if name == "1f1b_cu" else parallelism
        ddp = name in ("ddp", "ddp_one")
        shard = (
            (0 if name == "ddp_one" else rank // 2)
            if ddp
            else parse_parallelism(parallelism).data_coordinates(rank, world_size)[0]
        )
        torch.manual_seed(0)
        with torch.device("meta") if not ddp else contextlib.nullcontext():
            net = TransformerLM(vocab=VOCAB, width=32, heads=4, depth=4, length=SEQ)
        collate = cu_seqlens_rows if name == "1f1b_cu" else None
        loader = DataLoader(packed_rows(32, seed=100 + shard), batch_size=8, collate_fn=collate)
        counter = EventCounter()
        trainer = Trainer(
            model=net,
            train_dataloader=DataSpec(loader, get_num_tokens_in_batch=lambda b: int(b["num_tokens"].sum())),
            max_duration="4ba",
            optimizers=torch.optim.AdamW(net.parameters(), lr=2e-3),
            grad_accum=2 if ddp else 1,
            parallelism=parallelism,
            callbacks=[counter],
        )
        conversions[0] = 0
        trainer.fit()
        converted = conversions[0]
        predicted = [
            torch.cat(trainer.predict(DataLoader(rows(packed_batch(change)), batch_size=2))) for change in (False, True)
        ]
        out[name] = {
            "losses": counter.losses,
            "model": full_model_state(trainer.state.model),
            "timestamp": trainer.state.timestamp.state_dict(),
            "shard": shard,
            "predict": predicted,
            "conversions": converted,
        }
        trainer.close()
    return out
