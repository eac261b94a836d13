"""Sharded checkpoints: each rank writes its own shards with torch.distributed.checkpoint (DCP).

Layout of a sharded checkpoint directory (committed by ``manifest.json``, written last, as for
every checkpoint; the manifest's ``metadata["layout"]`` is ``"dcp"``)::

    .metadata              DCP's index of every shard (read with a restricted unpickler)
    __<rank>_<n>.distcp    the shards rank <rank> wrote: model, optimizer and algorithm tensors
    state.pt               rank 0: everything else (Timestamp, schedulers, algorithm and callback
                           state), with each tensor replaced by a reference into the DCP part
                           (under pipeline parallelism the union of every rank's references: each
                           stage's EMA averages; each rank loads those of its own stages)
    rng-rank<r>.pt         each rank's RNG state

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict`` (parameter
names as keys, for DDP and FSDP alike), so a checkpoint saved by N ranks loads on M ranks and
into the other strategy: DCP reads, on each rank, the parts of the saved shards that overlap
what that rank holds: rank 0 alone reads and verifies ``.metadata`` and broadcasts it, and each
rank reads only the bytes of the saved shards it needs (ranged reads, ``ranged_dcp.py``), so an
N -> M reshard reads about 1x the checkpoint in total. No rank gathers the full model. Loading goes through `SafeDCPReader` and
`SafeLoadPlanner` (``safe_dcp.py``): nothing in a crafted checkpoint runs.

Async save: the tensors are copied to reusable host buffers (pinned where CUDA exists,
``staging.py``) on the training thread, the only part that blocks training; the upload runs in
the background writer.
Checkpoint collectives (DCP's planning, gathering the file list) use their own gloo group,
so a background save never interleaves with the training collectives of the main thread.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

from raytrain_events.checkpoint.format.local_copy import LocalCopies
from raytrain_events.checkpoint.format.manifest import CheckpointError, CheckpointInfo, FileEntry, UnsafeCheckpointError
from raytrain_events.core.state import CheckpointMismatchError, mismatch_fix, model_mismatch
from raytrain_events.parallel.pipeline import pipeline_group

if TYPE_CHECKING:
    from raytrain_events.checkpoint.host import ShardHost

__all__ = [
    "DCP_LAYOUT",
    "ShardedCheckpointIO",
    "is_sharded_checkpoint",
    "load_consolidated",
    "load_full_into_sharded",
]

DCP_LAYOUT = "dcp"
_REF = "__dcp_tensor__"  # {_REF: key}: a tensor of state.pt that lives in the DCP part under extra/<key>


def is_sharded_checkpoint(info: CheckpointInfo) -> bool:
    """True if ``info`` is a DCP (sharded) checkpoint."""
    return info.metadata.get("layout") == DCP_LAYOUT


def state_optimizers(optimizers: List[Any]) -> List[Any]:
    """The optimizers whose state DCP reads and writes: one that wraps another (``.optim``: replica groups'
    `CommitOptimizer`, torchft's ``OptimizerWrapper``) gives the one it wraps, which holds the parameters and state.
    DCP's state-dict calls step an optimizer with no state (zero gradients, lr 0) to build it, and a wrapper's step
    is a collective across the replica groups: one that no other group joins when a lone group loads."""
    return [
        getattr(o, "optim", o) if isinstance(getattr(o, "optim", None), torch.optim.Optimizer) else o
        for o in optimizers
    ]


def split_tensors(tree: Any, path: Tuple[str, ...] = ()) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """``tree`` with each tensor replaced by ``{_REF: key}``, and ``{key: tensor}``."""
    tensors: Dict[str, torch.Tensor] = {}

    def walk(node: Any, where: Tuple[str, ...]) -> Any:
        if torch.is_tensor(node):
            key = "/".join(where)
            tensors[key] = node.detach()
            return {_REF: key}
        if isinstance(node, dict):
            return {k: walk(v, where + (str(k),)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, where + (str(i),)) for i, v in enumerate(node))
        return node

    return walk(tree, path), tensors


def fill_tensors(tree: Any, tensors: Dict[str, Any]) -> Any:
    """Undo `split_tensors`: put ``tensors[key]`` back where ``{_REF: key}`` stands."""
    if isinstance(tree, dict):
        if set(tree) == {_REF}:
            return tensors[tree[_REF]]
        return {k: fill_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(fill_tensors(v, tensors) for v in tree)
    return tree


def merge_skeletons(trees: List[Any]) -> Any:
    """The union of several ranks' `split_tensors` skeletons (pipeline parallelism: each rank's EMA
    averages name its stages' parameters only): dicts merge key by key, lists item by item, anything
    else is the first tree's."""
    first = trees[0]
    if isinstance(first, dict) and set(first) != {_REF}:
        keys = list(dict.fromkeys(k for tree in trees if isinstance(tree, dict) for k in tree))
        return {k: merge_skeletons([t[k] for t in trees if isinstance(t, dict) and k in t]) for k in keys}
    if isinstance(first, (list, tuple)) and all(isinstance(t, type(first)) and len(t) == len(first) for t in trees):
        return type(first)(merge_skeletons([t[i] for t in trees]) for i in range(len(first)))
    return first


def drop_refs(tree: Any, available: Dict[str, Any]) -> Any:
    """``tree`` without the dict entries whose tensor this rank did not load (pipeline parallelism:
    the averages of the other stages' parameters)."""
    if isinstance(tree, dict):
        if set(tree) == {_REF}:
            return tree
        return {
            k: drop_refs(v, available)
            for k, v in tree.items()
            if not (isinstance(v, dict) and set(v) == {_REF} and v[_REF] not in available)
        }
    if isinstance(tree, (list, tuple)):
        return type(tree)(drop_refs(v, available) for v in tree)
    return tree


class ShardedCheckpointIO:
    """Save and load the model, optimizers and algorithm tensors of one `Trainer` with DCP.

    Every rank makes the same calls in the same order (they are collective).
    """

    def __init__(
        self,
        host: ShardHost,
        storage_options: Optional[Dict[str, Any]] = None,
        own_group: bool = True,
        group: Any = None,
    ) -> None:
        """``group``: the process group for checkpoint collectives (a background save's own);
        without one, ``own_group`` makes a gloo group, else the default group is used."""
        self.host = host
        self.options = dict(storage_options or {})
        self.distributed = host.dist.is_distributed
        self.group = group  # None: the default group (collectives on the training thread only)
        if self.distributed and group is None and own_group:
            import torch.distributed as tdist

            self.group = tdist.new_group(backend="gloo")

    # ------------------------------------------------------------------ save
    def snapshot(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(tensors for DCP, the rest for state.pt), not copied (an async save stages both)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state = self.host.state
        model_sd, optim_sd = get_state_dict(state.model, state_optimizers(state.optimizers))
        if pipeline_group(state.model) is not None and optim_sd:
            optim_sd["param_groups"] = self._all_stages_groups(optim_sd["param_groups"])
        rest = state.state_dict()
        rest.pop("model")
        rest.pop("optimizers")
        rest, extra = split_tensors(rest)
        if pipeline_group(state.model) is not None:  # rank 0 writes state.pt: it must name every stage's tensors
            import torch.distributed as tdist

            gathered: List[Any] = [None] * self.host.dist.world_size
            tdist.all_gather_object(gathered, rest, group=self.group)
            rest = merge_skeletons(gathered)
        tensors = {"model": model_sd, "optim": optim_sd, "extra": extra}
        return tensors, rest

    def _all_stages_groups(self, groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Pipeline parallelism: the optimizer's param groups naming every stage's parameters. DCP
        writes one rank's copy of them (not tensors), which on its own names one stage's only, and
        a load on another layout would find the other parameters in no group."""
        import torch.distributed as tdist

        gathered: List[Any] = [None] * self.host.dist.world_size
        tdist.all_gather_object(gathered, [group["params"] for group in groups], group=self.group)
        merged = [dict(group) for group in groups]
        for index, group in enumerate(merged):
            names = [name for rank_groups in gathered for name in rank_groups[index]]
            group["params"] = list(dict.fromkeys(names))
        return merged

    def write_shards(self, url: str, tensors: Dict[str, Any], local: Optional[LocalCopies] = None) -> List[FileEntry]:
        """Every rank writes its shards under ``url`` (and, with ``local``, into its node-local copy in the same
        pass); returns the entries of all ranks' files."""
        import torch.distributed.checkpoint as dcp

        # why here: safe_dcp imports torch.distributed.checkpoint (~0.7 s), for sharded checkpoints only
        from raytrain_events.checkpoint.dcp.safe_dcp import HashingDCPWriter

        writer = HashingDCPWriter(url, storage_options=self.options, local_copy=local)
        with _plain_errors("Saving", url):
            dcp.save(tensors, storage_writer=writer, process_group=self.group, no_dist=not self.distributed)
        entries = writer.entries
        if not self.distributed:
            return entries
        import torch.distributed as tdist

        gathered: List[Any] = [None] * self.host.dist.world_size
        tdist.all_gather_object(gathered, entries, group=self.group)
        return [entry for rank_entries in gathered for entry in rank_entries]

    # ------------------------------------------------------------------ load
    def shared_metadata(self, info: CheckpointInfo, local: Optional[LocalCopies] = None) -> Any:
        """The checkpoint's DCP `Metadata`, read and verified (safe unpickler, then the manifest's
        size and checksum) by rank 0 alone and broadcast: one ``.metadata`` read per load instead
        of two per rank. An error on rank 0 (refused, corrupt, missing) is raised on every rank,
        so no rank waits for the others. ``local``: the node-local copy to read it from where it matches."""
        # why here: safe_dcp imports torch.distributed.checkpoint (~0.7 s), for sharded checkpoints only
        from raytrain_events.checkpoint.dcp.safe_dcp import SafeDCPReader

        expected = next((f for f in info.files if f.name == ".metadata"), None)
        url = info.url

        def read() -> Any:
            return SafeDCPReader(
                url, expected=expected, local=local, entries=info.files, **self.options
            ).read_metadata()

        if not self.distributed:
            return read()
        import torch.distributed as tdist

        shared: List[Any] = [None]
        if tdist.get_rank() == 0:
            try:
                shared[0] = read()
            except Exception as e:  # every rank raises it
                shared[0] = e
        tdist.broadcast_object_list(shared, src=0, group=self.group)
        if isinstance(shared[0], BaseException):
            raise shared[0]
        return shared[0]

    def _model_shapes(self, model_sd: Dict[str, Any]) -> Dict[str, tuple]:
        """The model's parameter shapes by name; under pipeline parallelism those of every rank (each
        holds its stages' layers only), gathered once per load."""
        shapes = {k: tuple(v.shape) for k, v in model_sd.items()}
        if pipeline_group(self.host.state.model) is None:
            return shapes
        import torch.distributed as tdist

        gathered: List[Any] = [None] * self.host.dist.world_size
        tdist.all_gather_object(gathered, shapes, group=self.group)
        return {k: v for rank_shapes in gathered for k, v in rank_shapes.items()}

    def load(
        self,
        info: CheckpointInfo,
        rest: Dict[str, Any],
        *,
        strict: bool,
        weights_only: bool,
        local: Optional[LocalCopies] = None,
    ) -> None:
        """Load a sharded checkpoint into the host's state (any rank count, DDP or FSDP); ``local``: the
        node-local copy each file is read from where it matches the manifest (else storage)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # why here: safe_dcp imports torch.distributed.checkpoint (~0.7 s), for sharded checkpoints only
        from raytrain_events.checkpoint.dcp.safe_dcp import SafeDCPReader, SafeLoadPlanner

        state = self.host.state
        metadata = self.shared_metadata(info, local)
        model_sd = get_model_state_dict(state.model)
        shapes = self._model_shapes(model_sd)
        _check_model_keys(info.url, metadata, shapes, strict)
        target: Dict[str, Any] = {"model": model_sd}
        pipelined = pipeline_group(state.model) is not None
        if not weights_only:
            target["optim"] = get_optimizer_state_dict(state.model, state_optimizers(state.optimizers))
            others = set(shapes) - set(model_sd) if pipelined else set()  # the other stages' parameter names
            target["extra"] = _extra_targets(metadata, model_sd, others)
        if not strict:
            target["model"] = {k: v for k, v in model_sd.items() if f"model.{k}" in metadata.state_dict_metadata}
        with _plain_errors("Loading", info.url):
            dcp.load(
                target,
                storage_reader=SafeDCPReader(info.url, metadata, local=local, entries=info.files, **self.options),
                planner=SafeLoadPlanner(),
                process_group=self.group,
                no_dist=not self.distributed,
            )
        set_model_state_dict(state.model, target["model"], options=StateDictOptions(strict=strict))
        if weights_only:
            return
        set_optimizer_state_dict(state.model, state_optimizers(state.optimizers), target["optim"])
        if pipelined:  # state.pt names every stage's averages; this rank loaded its own
            rest = drop_refs(rest, target["extra"])
        state.load_state_dict(fill_tensors(rest, target["extra"]), strict=strict)


@contextlib.contextmanager
def _plain_errors(what: str, url: str) -> Iterator[None]:
    """DCP raises a CheckpointException (a BaseException, which ``except Exception`` misses) holding
    each failed rank's error. A refused (unsafe) item is raised as the `UnsafeCheckpointError` it
    is; anything else as a `CheckpointError` naming the ranks and their errors."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        errors = {rank: (f[0] if isinstance(f, tuple) else f) for rank, f in e.failures.items()}
        for inner in errors.values():
            if isinstance(inner, UnsafeCheckpointError):
                raise inner from None
        detail = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, err in sorted(errors.items()))
        raise CheckpointError(
            f"{what} the sharded checkpoint {url!r} failed ({detail}). A save that fails is never committed: the "
            "previous checkpoint stays the latest. Fix: the storage error above (space, permissions, endpoint)."
        ) from e


def _check_model_keys(url: str, metadata: Any, shapes: Dict[str, tuple], strict: bool) -> None:
    saved = {
        k[len("model.") :]: (tuple(v.size) if hasattr(v, "size") else None)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.")
    }
    problem = model_mismatch(shapes, saved, strict)
    if problem:
        raise CheckpointMismatchError(
            f"The sharded checkpoint {url!r} does not match this model ({problem}). {mismatch_fix(problem)}"
        )


def _extra_targets(metadata: Any, model_sd: Dict[str, Any], others: Any = ()) -> Dict[str, torch.Tensor]:
    """Tensors to load the algorithm/callback tensors into: sharded like the model parameter of the
    same name and shape where there is one (EMA's averages of FSDP shards), else full tensors; none
    for those named like a parameter in ``others`` (another pipeline stage's: that rank loads them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    targets: Dict[str, torch.Tensor] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(fqn) if metadata.planner_data else None
        if not path or path[0] != "extra" or not isinstance(item, TensorStorageMetadata):
            continue
        key = path[1]
        name = key.rsplit("/", 1)[-1]
        if name in others:
            continue
        like = model_sd.get(name)
        if like is not None and tuple(like.shape) == tuple(item.size):
            targets[key] = torch.empty_like(like, dtype=item.properties.dtype)
        else:
            targets[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    return targets


def load_consolidated(
    info: CheckpointInfo, rest: Dict[str, Any], storage_options: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """One process: the whole sharded checkpoint as full tensors (``model``, ``optim`` by
    parameter name, and the rest of the state), for inference or export."""
    # dcp.load fills only keys the given dict has; this is what DCP's own dcp_to_torch_save calls.
    # why here: both import torch.distributed.checkpoint (~0.7 s), for sharded checkpoints only
    from raytrain_events._torch_compat import load_whole_state_dict as _load_state_dict
    from raytrain_events.checkpoint.dcp.safe_dcp import SafeDCPReader, SafeFullLoadPlanner

    loaded: Dict[str, Any] = {}
    with _plain_errors("Loading", info.url):
        _load_state_dict(
            loaded,
            storage_reader=SafeDCPReader(info.url, **(storage_options or {})),
            planner=SafeFullLoadPlanner(),
            no_dist=True,
        )
    out = fill_tensors(rest, loaded.get("extra", {}))
    out["model"] = loaded["model"]
    out["optim"] = loaded.get("optim", {})
    return out


def load_full_into_sharded(state: Any, saved: Dict[str, Any], *, strict: bool, weights_only: bool) -> None:
    """A full checkpoint (``state.pt`` of a DDP run) into an FSDP-sharded model: every rank read the
    whole file; each keeps its shard. Optimizer state is re-keyed from positions to parameter names."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=strict)
    _check_full_keys(state, saved["model"], strict)
    set_model_state_dict(state.model, saved["model"], options=options)
    if weights_only:
        return
    names = {id(p): n for n, p in state.model.named_parameters()}
    saved_optimizers = saved.get("optimizers", [])
    if len(saved_optimizers) != len(state.optimizers):
        raise CheckpointMismatchError(
            f"The checkpoint has {len(saved_optimizers)} optimizers but this run has {len(state.optimizers)}; "
            "build the run with the same optimizers, or load weights only."
        )
    for optimizer, osd in zip(state.optimizers, saved_optimizers):
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name = {
            "state": {order[int(i)]: v for i, v in osd["state"].items()},
            "param_groups": [dict(g, params=[order[int(i)] for i in g["params"]]) for g in osd["param_groups"]],
        }
        set_optimizer_state_dict(state.model, optimizer, by_name, options=options)
    rest = {k: v for k, v in saved.items() if k not in ("model", "optimizers")}
    state.load_state_dict(_shard_like_model(rest, state.model), strict=strict)


def _shard_like_model(tree: Any, model: torch.nn.Module) -> Any:
    """Algorithm tensors named and shaped like a sharded parameter (EMA's average) become this rank's
    shard of it, as in the DCP path; every rank holds the full tensor, so no communication."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, DTensor)}
    skeleton, tensors = split_tensors(tree)
    for key, tensor in tensors.items():
        like = params.get(key.rsplit("/", 1)[-1])
        if like is not None and tuple(like.shape) == tuple(tensor.shape):
            tensors[key] = distribute_tensor(
                tensor.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
            )
    return fill_tensors(skeleton, tensors)


def _check_full_keys(state: Any, saved_model: Dict[str, Any], strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    current = get_model_state_dict(state.model)
    missing = sorted(set(current) - set(saved_model))
    unexpected = sorted(set(saved_model) - set(current))
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(current[k].shape)}"
        for k, v in saved_model.items()
        if k in current and tuple(v.shape) != tuple(current[k].shape)
    ]
    if mismatched or (strict and (missing or unexpected)) or (current and len(missing) == len(current)):
        problem = (
            f"shape mismatch: {mismatched[:10]}, missing in checkpoint: {missing[:10]}, not in model: {unexpected[:10]}"
            if mismatched
            else f"missing in checkpoint: {missing[:10]}, not in model: {unexpected[:10]}"
        )
        raise CheckpointMismatchError(f"The checkpoint does not match this model ({problem}). {mismatch_fix(problem)}")
