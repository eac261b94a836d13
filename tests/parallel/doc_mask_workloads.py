"""Rank functions for the document-mask tests (importable by spawned ranks): the example transformer's
outputs on a packed batch, whole on one process and cut by context parallelism over a group."""

from __future__ import annotations

from typing import Any, Dict

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
    for name, change in (("base", False), ("changed", True)):
        part = cp.split(packed_batch(change))
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
