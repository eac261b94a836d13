"""Cut a model into pipeline stages: which blocks each stage holds, and the part of the model one
rank keeps (its stages' layers, nothing else).

The model protocol for ``FSDPConfig(pipeline_parallel=p)``: the model's body is a repeated block
list (an ``nn.ModuleList``, found by itself, or the one the model names in ``pipeline_blocks = "name"``),
and the model splits its ``forward`` in three::

    def pipeline_embed(self, batch):   # the first stage: what runs before the blocks
        return self.tokens(batch["input_ids"]) + ...
    def pipeline_head(self, hidden):   # the last stage: what runs after them; loss() takes its outputs
        return self.head(self.norm(hidden))
    def pipeline_block(self, block, hidden, microbatch):  # optional: how a stage calls a block
        return block(hidden, microbatch.get("document_ids"))

Without ``pipeline_block`` a stage calls ``block(hidden)`` and sends the next stage the hidden state
only. With it, each block call gets the microbatch it runs (the loaded batch's split: a packed
batch's ``document_ids`` for the document masks), on every stage: every rank of a pipeline holds
the batch's microbatches (`Feed.microbatches`), so only the microbatch's index travels, as a second
output of each stage (one ``int64`` of one element per microbatch and stage boundary, beside the
activation; no gradient: the schedule's backward skips outputs that need none). The schedule's
first step infers the stages' shapes from placeholder inputs (an uninitialised index on every stage
but the first): the index is taken modulo the microbatch count there, so that forward sees some
microbatch of the batch (all have the same shapes).

The model's child modules registered before the block list belong to the first stage, those after
it to the last (the order ``__init__`` builds them in). The blocks are cut evenly over the
``stages = pipeline_parallel * pipeline_stages_per_rank`` stages (refused when ``stages`` does not
divide them), or as ``pipeline_split`` says (blocks per stage). Stage ``s`` runs on pipeline rank
``s % pipeline_parallel`` (the interleaved schedules' loop order).

`keep_stages` prunes the model in place: the blocks no stage of this rank holds, and the first or
last part when the rank holds neither end, are removed before anything is materialised, so a model
built on the meta device allocates only this rank's layers. The kept blocks keep their names
(``blocks.5.mlp.fc.weight``), so checkpoints hold the same keys under any stage count and reshard
across them (and into an unpipelined model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["StageBlocks", "StageLayout", "find_blocks", "keep_stages", "plan_stages"]

EMBED, HEAD, BLOCK = "pipeline_embed", "pipeline_head", "pipeline_block"


def find_blocks(model: torch.nn.Module) -> Tuple[str, torch.nn.ModuleList]:
    """The model's block list: ``model.pipeline_blocks`` (an attribute name) if given, else its one
    ``nn.ModuleList`` child; refuses a model without one, or without the protocol's methods."""
    missing = [name for name in (EMBED, HEAD) if not callable(getattr(model, name, None))]
    if missing:
        raise ValueError(
            f"pipeline_parallel needs {type(model).__name__} to split its forward in three: {', '.join(missing)} "
            f"missing. Fix: define {EMBED}(batch) -> hidden (what runs before the blocks) and {HEAD}(hidden) -> "
            "outputs (what runs after them); see raytrain_events/parallel/pipeline_split.py and "
            "examples/transformer_lm.py."
        )
    named = getattr(model, "pipeline_blocks", None)
    if named is not None:
        blocks = getattr(model, named, None)
        if not isinstance(blocks, torch.nn.ModuleList):
            raise ValueError(f"{type(model).__name__}.pipeline_blocks={named!r} names no nn.ModuleList of the model.")
        return named, blocks
    lists = [(name, child) for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList)]
    if len(lists) != 1:
        found = [name for name, _ in lists]
        raise ValueError(
            f"pipeline_parallel cuts the model's block list, but {type(model).__name__} has {len(lists)} nn.ModuleList "
            f"children {found}. Fix: name it, pipeline_blocks = 'name' on the model."
        )
    return lists[0]


@dataclass(frozen=True)
class StageLayout:
    """Which blocks each of the ``stages`` stages holds (``ranges[s] = (start, stop)``), over ``degree`` ranks."""

    ranges: Tuple[Tuple[int, int], ...]
    degree: int

    @property
    def stages(self) -> int:
        return len(self.ranges)

    def stages_of(self, pipeline_rank: int) -> List[int]:
        """The stages pipeline rank ``pipeline_rank`` runs: ``rank, rank + degree, ...`` (loop order)."""
        return list(range(pipeline_rank, self.stages, self.degree))


def plan_stages(blocks: int, degree: int, per_rank: int, split: Optional[Sequence[int]]) -> StageLayout:
    """The stages' block ranges: ``split`` (blocks per stage) or an even cut; bad counts raise naming the fix."""
    stages = degree * per_rank
    if split is None:
        if blocks % stages:
            divisors = [d for d in range(1, blocks + 1) if blocks % d == 0 and d % per_rank == 0]
            raise ValueError(
                f"pipeline_parallel={degree} x pipeline_stages_per_rank={per_rank} = {stages} stages do not divide the "
                f"model's {blocks} blocks evenly. Fix: a stage count among {divisors}, or pipeline_split=[...] "
                f"(blocks per stage, {stages} numbers summing to {blocks})."
            )
        split = [blocks // stages] * stages
    if sum(split) != blocks:
        raise ValueError(
            f"FSDPConfig.pipeline_split={list(split)} sums to {sum(split)} blocks, but the model has {blocks}. Fix: "
            f"{stages} block counts summing to {blocks}."
        )
    starts = [sum(split[:s]) for s in range(stages)]
    return StageLayout(tuple((start, start + n) for start, n in zip(starts, split)), degree)


class StageBlocks(torch.nn.Module):
    """The blocks a rank keeps, under their original indices (``"4"``, ``"5"``), iterated in order:
    what replaces the model's ``nn.ModuleList`` so parameter names stay those of the whole model."""

    def __init__(self, blocks: Dict[int, torch.nn.Module]) -> None:
        super().__init__()
        for index in sorted(blocks):
            self.add_module(str(index), blocks[index])

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> torch.nn.Module:
        return self._modules[str(index)]  # type: ignore[return-value]


class StageModule(torch.nn.Module):
    """One stage as a module of its own (what `PipelineStage` runs and FSDP wraps): the model's first
    part (first stage), its range of blocks, its last part (last stage); the modules are the model's
    own (shared), so ``state.model`` sees the sharded parameters. ``feed(index)`` gives the first
    stage the microbatch by its index (the schedule sends only tensors between stages). When the
    model has ``pipeline_block`` (`passes_index`), a stage but the last returns ``(hidden, index)``
    and the next takes both, so each stage's blocks get their microbatch (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: List[torch.nn.Module],
        first_part: Optional[List[torch.nn.Module]],
        last_part: Optional[List[torch.nn.Module]],
        feed: Any,
    ) -> None:
        """``first_part`` / ``last_part``: the model's modules before / after the blocks on the first /
        last stage, None on the others."""
        super().__init__()
        first, last = first_part is not None, last_part is not None
        self.edge_first = torch.nn.ModuleList(first_part or [])
        self.body = torch.nn.ModuleList(blocks)
        self.edge_last = torch.nn.ModuleList(last_part or [])
        self._model = [model]  # a list: not registered as a child (its other stages' layers are not ours)
        self.first, self.last, self._feed = first, last, feed
        self.passes_index = callable(getattr(model, BLOCK, None))

    def forward(self, x: torch.Tensor, index: Optional[torch.Tensor] = None) -> Any:
        """``x``: the microbatch's index (first stage) or the previous stage's hidden state, with
        ``index`` the microbatch's index when `passes_index`."""
        model, feed = self._model[0], self._feed
        with feed.autocast():
            if self.first:
                index = x
                x = getattr(model, EMBED)(feed.microbatch(x))
            with feed.attention(index):  # context parallelism: attention over the stage's context group
                if self.passes_index:
                    if index is None:
                        raise TypeError("A stage of a model with pipeline_block takes (hidden, microbatch index).")
                    microbatch, call = feed.loaded(index), getattr(model, BLOCK)
                    for block in self.body:
                        x = call(block, x, microbatch)
                else:
                    for block in self.body:
                        x = block(x)
            if self.last:
                return getattr(model, HEAD)(x)
        if index is not None and self.passes_index:
            return x, index.detach().clone()  # a new tensor: a stage's output is not its input
        return x


def _edges(model: torch.nn.Module) -> Tuple[List[torch.nn.Module], List[torch.nn.Module]]:
    """The model's children before and after its block list (the first and last stage's parts)."""
    name, _ = find_blocks(model)
    children = list(model.named_children())
    at = [n for n, _ in children].index(name)
    return [m for _, m in children[:at]], [m for _, m in children[at + 1 :]]


def keep_stages(
    model: torch.nn.Module, layout: StageLayout, pipeline_rank: int
) -> Tuple[Dict[int, List[torch.nn.Module]], Tuple[List[torch.nn.Module], List[torch.nn.Module]]]:
    """Prune ``model`` in place to pipeline rank ``pipeline_rank``'s stages; returns ``{stage: its blocks}``
    and the model's first and last parts (its children before and after the blocks). The model was
    checked first (`raytrain_events.parallel.pipeline.check_pipelined_model`)."""
    name, blocks = find_blocks(model)
    if len(blocks) < layout.stages:
        raise ValueError(
            f"pipeline_parallel: {layout.stages} stages need at least as many blocks, but {type(model).__name__}.{name} "
            f"has {len(blocks)}. Fix: fewer stages (pipeline_parallel x pipeline_stages_per_rank)."
        )
    mine = layout.stages_of(pipeline_rank)
    held = {s: [(i, blocks[i]) for i in range(*layout.ranges[s])] for s in mine}
    before, after = _edges(model)
    children = dict(model.named_children())
    drop = [] if 0 in mine else before
    drop += [] if layout.stages - 1 in mine else after
    for child_name, child in children.items():
        if any(child is d for d in drop):
            delattr(model, child_name)
            setattr(model, child_name, None)  # the protocol's methods never run on a stage without them
    setattr(model, name, StageBlocks({i: b for pairs in held.values() for i, b in pairs}))
    return {s: [b for _, b in pairs] for s, pairs in held.items()}, (before, after)
