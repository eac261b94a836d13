"""A small GPT-style decoder in plain PyTorch, with the tensor-parallel plan of its blocks, trained
on random tokens: the model that `FSDPConfig(tensor_parallel=t)` is shown and tested with.

    python examples/transformer_lm.py            # one process, 20 batches on the CPU

On workers (Ray or ``torchrun``), FSDP x TP over 4 ranks, each pair of ranks splitting every block::

    Trainer(model=TransformerLM(), parallelism=FSDPConfig(shard_modules=["Block"], tensor_parallel=2), ...)

Each `Block` says how to split itself (``tensor_parallel_plan``): the q/k/v projections and the
MLP's first layer column-wise, the attention output and the MLP's second layer row-wise (Megatron's
plan), so each rank of a tensor group holds ``heads / t`` heads and ``4 * width / t`` MLP units.
Global shapes it needs: ``heads`` and ``4 * width`` divisible by ``t`` (``width`` by ``heads``).
Attention reshapes with ``-1`` heads, so the same code runs whole or split. The ``t`` ranks of one
tensor group must see the same batches: shard the data by `Parallel.data_parallel` (``rank // t``).

Pipeline parallelism (``FSDPConfig(pipeline_parallel=p)``): ``blocks`` is the block list the stages
cut, ``pipeline_embed`` runs on the first stage and ``pipeline_head`` on the last, and
``pipeline_block`` gives each block its microbatch's document ids (and under context parallelism its
part's positions) on every stage (packed batches keep their document masks;
`raytrain_events.parallel.pipeline_split`).

Context parallelism (``FSDPConfig(context_parallel=c)``): attention is plain SDPA, so it can be
split along the sequence; ``context_parallel_split`` cuts a batch (global ``positions``, ``labels``
shifted before the cut) and ``forward``/``loss`` take the cut batch.

Packed sequences (``raytrain_events.data.ray.packed_source.PackedTokens``): a batch with
``document_ids`` and ``position_ids`` trains with document masks (block-causal attention,
``raytrain_events.parallel.document_attention``: no token attends across a document, under CP and
TP too), position embeddings restarting at each document, and no loss on the token after a
document's last one nor on padding. A ``cu_seqlens`` batch (``PackedTokens(document_format=
"cu_seqlens")``) gets the same masks, positions and labels (`document_attention.with_document_ids`).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from raytrain_events.parallel.document_attention import PAD_DOCUMENT, document_attention, with_document_ids

__all__ = ["Block", "TransformerLM", "next_tokens", "random_tokens"]


class Attention(torch.nn.Module):
    """Causal self-attention; ``heads`` of ``width // heads`` each (fewer per rank when split)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q = torch.nn.Linear(width, width)
        # No key bias: it adds q.b to every score of a row, which softmax removes, so its gradient is
        # exactly zero and Adam would turn rounding noise into full-size steps.
        self.k = torch.nn.Linear(width, width, bias=False)
        self.v = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, docs: Optional[torch.Tensor] = None, cut: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``docs``: the whole sequence's document ids (document masks); ``cut``: a CP rank's positions."""
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if docs is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = document_attention(q, k, v, docs, cut)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


class MLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, 4 * width)
        self.proj = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(torch.nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}.")
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(
        self, x: torch.Tensor, docs: Optional[torch.Tensor] = None, cut: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), docs, cut)
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]

    def tensor_parallel_plan(self, degree: int) -> Dict[str, str]:
        """Which Linear layers to split over ``degree`` tensor-parallel ranks, and how."""
        if self.heads % degree:
            raise ValueError(
                f"Block has {self.heads} attention heads, which {degree} tensor-parallel ranks cannot split. "
                f"Fix: a head count divisible by {degree}, or tensor_parallel dividing {self.heads}."
            )
        return {
            "attn.q": "colwise",
            "attn.k": "colwise",
            "attn.v": "colwise",
            "attn.out": "rowwise",
            "mlp.fc": "colwise",
            "mlp.proj": "rowwise",
        }


class TransformerLM(torch.nn.Module):
    """Token + position embeddings, ``depth`` blocks, a final norm and an (untied) output head.

    The model protocol of the loop: ``forward(batch)`` gives logits for ``batch["input_ids"]``,
    ``loss(logits, batch)`` is next-token cross-entropy.
    """

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, depth: int = 2, length: int = 16) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(length, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        batch = with_document_ids(batch)  # a cu_seqlens batch: its document masks from cu_seqlens
        x = self.pipeline_embed(batch)
        docs = batch.get("document_ids")  # packed documents: the whole sequence's (CP leaves it uncut)
        cut = batch.get("positions")  # context parallelism: the global positions of this rank's part
        for block in self.blocks:
            x = block(x, docs, cut)
        return self.pipeline_head(x)

    def pipeline_embed(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """What runs before the blocks (the first pipeline stage's part; ``FSDPConfig(pipeline_parallel=p)``)."""
        batch = with_document_ids(batch)  # a pipeline's cu_seqlens microbatch (forward's batch is converted already)
        ids = batch["input_ids"].long()
        cut = batch.get("positions")  # context parallelism: the global positions of this rank's part
        positions = torch.arange(ids.shape[1], device=ids.device) if cut is None else cut
        if "position_ids" in batch:  # packed: positions restart at each document
            positions = batch["position_ids"].long() if cut is None else batch["position_ids"][:, cut].long()
        return self.tokens(ids) + self.positions(positions)  # type: ignore[no-any-return]

    def pipeline_block(self, block: torch.nn.Module, x: torch.Tensor, microbatch: Dict[str, torch.Tensor]) -> Any:
        """How a pipeline stage calls a block: with the microbatch's document ids (packed batches keep
        their document masks on every stage) and, under context parallelism, its part's positions."""
        microbatch = with_document_ids(microbatch)  # a cu_seqlens microbatch: its ids on every stage
        return block(x, microbatch.get("document_ids"), microbatch.get("positions"))

    def pipeline_head(self, x: torch.Tensor) -> torch.Tensor:
        """What runs after the blocks (the last pipeline stage's part): logits."""
        return self.head(self.norm(x))  # type: ignore[no-any-return]

    def loss(self, logits: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        batch = with_document_ids(batch)
        if "labels" in batch:  # a context-parallel part: labels shifted before the cut, summed over its share
            flat = logits.reshape(-1, logits.shape[-1])
            total = F.cross_entropy(flat, batch["labels"].reshape(-1), ignore_index=-100, reduction="sum")
            return total / batch["label_count"]
        targets = next_tokens(batch)[:, :-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

    def context_parallel_split(self, batch: Dict[str, torch.Tensor], index: int, degree: int) -> Dict[str, Any]:
        """Rank ``index``'s part of ``batch`` under ``FSDPConfig(context_parallel=degree)``: the
        load-balanced cut of the sequence, with labels and positions (``split_token_batch``)."""
        from raytrain_events.parallel.context_parallel import split_token_batch

        batch = with_document_ids(batch)  # CP cuts per-token columns
        part = split_token_batch(batch, index, degree)
        if "document_ids" in batch:  # packed: no label across a document's end or on padding
            labels = next_tokens(batch)
            part["labels"] = labels[:, part["positions"]]
            part["label_count"] = (labels != -100).sum() / degree
        return part


def next_tokens(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Each position's next-token label, ``-100`` (ignored) after the last token and, in packed
    sequences, where the next token starts another document or is padding."""
    ids = batch["input_ids"].long()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    docs = batch.get("document_ids")
    if docs is not None:
        same = torch.zeros_like(ids, dtype=torch.bool)
        same[:, :-1] = (docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] != PAD_DOCUMENT)
        labels = labels.masked_fill(~same, -100)
    return labels


def random_tokens(rows: int, vocab: int = 64, length: int = 16, seed: int = 0) -> Any:
    """A list of ``{"input_ids": ...}`` rows of random tokens (a Dataset for a DataLoader)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    return [{"input_ids": row} for row in ids]


def main(argv: Any) -> int:
    from torch.utils.data import DataLoader

    from raytrain_events import Trainer

    torch.manual_seed(0)
    model = TransformerLM()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(160), batch_size=8),
        max_duration="20ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
    )
    trainer.fit()
    print(f"trained {trainer.state.timestamp.batch.value} batches, last loss {float(trainer.state.loss):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
