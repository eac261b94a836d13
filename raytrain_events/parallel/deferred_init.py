"""Deferred initialisation: a model built on the meta device is sharded first, then materialised.

Why: building the full model on every rank before sharding needs ``world_size`` full copies per
host (a 7B fp32 model is 28 GB per rank). Built on the meta device, a model has shapes and no
storage; the loop shards it (FSDP), allocates only this rank's shards (``to_empty``) and
initialises them, or loads them from a checkpoint. The pattern::

    def build():
        torch.manual_seed(0)
        with torch.device("meta"):
            return MyModel(...)

How the shards are initialised, in this order of preference:

* ``model.init_weights()`` if the root model defines it (torchtitan's convention): called once,
  under ``torch.no_grad()``, on the materialised (sharded) parameters. It must write every
  parameter and buffer; what values it draws is up to it.
* Otherwise every module that owns meta tensors and defines ``reset_parameters()`` (all of
  ``torch.nn``'s layers do) is re-run one module at a time, children before parents (the order
  their constructors ran): its parameters are built full for that one call, then only this
  rank's shard is kept. Peak memory is this rank's shards plus one module's full parameters, and
  the values are exactly what eager construction draws: the torch RNG is set, for the duration,
  to its state when the `Trainer` received the model (so a factory that seeds and then builds
  on meta gives the same parameters as the same factory building eagerly).

Under pipeline parallelism a rank keeps only its stages' layers; the others' are drawn on temporary
tensors one module at a time and dropped (`_draw_and_drop`), so the kept ones get the eager values.

Under FSDP x TP the split layers' parameters are 2-D DTensors (the tensor split, then FSDP's shard
of it: ``(_StridedShard, Shard)`` for a column-wise layer); `local_part` cuts a rank's part of the
full layer as views for those too, so the peak stays this rank's parameters plus one layer.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from raytrain_events._torch_compat import StridedShard

__all__ = ["DeferredInit", "has_meta_tensors", "local_part"]


def _direct_tensors(module: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """The module's own parameters and buffers (not its children's), by name, through torch's public API."""
    return {
        **dict(module.named_parameters(recurse=False, remove_duplicate=False)),
        **dict(module.named_buffers(recurse=False, remove_duplicate=False)),
    }


def _own_parameters(module: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    return dict(module.named_parameters(recurse=False, remove_duplicate=False))


def _is_meta(tensor: Optional[torch.Tensor]) -> bool:
    return tensor is not None and tensor.device.type == "meta"


def has_meta_tensors(model: torch.nn.Module) -> bool:
    """True if any parameter or buffer of ``model`` is on the meta device (deferred init)."""
    return any(_is_meta(t) for t in model.parameters()) or any(_is_meta(t) for t in model.buffers())


def _post_order(module: torch.nn.Module) -> List[torch.nn.Module]:
    out: List[torch.nn.Module] = []
    for child in module.children():
        out += _post_order(child)
    out.append(module)
    return out


class DeferredInit:
    """Materialises a meta-device model after sharding; built (with the RNG snapshot) when the
    `Trainer` receives the model, run by `Parallel.wrap`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rng_state = torch.random.get_rng_state()
        self.use_init_weights = callable(getattr(model, "init_weights", None))
        self.modules = [m for m in _post_order(model) if any(_is_meta(t) for t in _direct_tensors(m).values())]
        if not self.use_init_weights:
            missing = [m for m in self.modules if not callable(getattr(m, "reset_parameters", None))]
            if missing:
                names = {id(m): n or "<root>" for n, m in model.named_modules()}
                listed = ", ".join(f"{names.get(id(m), '?')} ({type(m).__name__})" for m in missing[:5])
                raise ValueError(
                    f"The model was built on the meta device, but these modules own meta parameters or buffers and "
                    f"define no reset_parameters(): {listed}. Nothing can initialise them after sharding. Fix: give "
                    "those modules a reset_parameters() (or the model an init_weights()) that fills every tensor, "
                    "or build them outside `with torch.device('meta')`."
                )

    def materialize(self, model: torch.nn.Module, device: torch.device, sharded: bool) -> None:
        """Allocate ``model``'s meta tensors on ``device`` (only this rank's shards if ``sharded``) and
        initialise them; the parameter objects may change (re-point optimizers by name afterwards)."""
        if sharded:
            mixed = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not _is_meta(t)]
            if mixed:
                raise ValueError(
                    f"Under FSDP a model built on the meta device must be built there whole, but {mixed[:5]} are "
                    "not on the meta device. Fix: build the entire model inside `with torch.device('meta')`."
                )
            model.to_empty(device=device)
        else:
            for module in self.modules:
                for name, tensor in _direct_tensors(module).items():
                    if not _is_meta(tensor):
                        continue
                    assert tensor is not None
                    empty = torch.empty_like(tensor, device=device)
                    if name in _own_parameters(module):  # setattr keeps a parameter's or buffer's registration
                        setattr(module, name, torch.nn.Parameter(empty, requires_grad=tensor.requires_grad))
                    else:
                        setattr(module, name, empty)
        kept = {id(m) for m in model.modules()}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.random.set_rng_state(self.rng_state)
            if self.use_init_weights:
                model.init_weights()  # type: ignore[operator]
            else:
                for module in self.modules:
                    if id(module) in kept:
                        _reset_one(module, device)
                    else:  # pruned (another pipeline stage's layer): drawn, so the RNG stream matches, then dropped
                        _draw_and_drop(module, device)


def _draw_and_drop(module: torch.nn.Module, device: torch.device) -> None:
    """``module.reset_parameters()`` on temporary full tensors, then its meta tensors back: the module
    is not this rank's (pipeline parallelism pruned it), but the draws it makes advance the RNG as in
    eager construction, so the kept layers get the values an unpipelined model gives them."""
    saved = {name: t for name, t in _direct_tensors(module).items() if _is_meta(t)}
    owned = _own_parameters(module)
    for name, tensor in saved.items():
        assert tensor is not None
        empty = torch.empty_like(tensor, device=device)
        setattr(module, name, torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if name in owned else empty)
    try:
        module.reset_parameters()  # type: ignore[operator]
    finally:
        for name, tensor in saved.items():
            setattr(module, name, tensor)


def _reset_one(module: torch.nn.Module, device: torch.device) -> None:
    """``module.reset_parameters()`` on full tensors, then keep only this rank's shard of each."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {n: p for n, p in _own_parameters(module).items() if isinstance(p, DTensor)}
    for name, param in sharded.items():
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        setattr(module, name, torch.nn.Parameter(full, requires_grad=param.requires_grad))
    try:
        module.reset_parameters()  # type: ignore[operator]
        for name, param in sharded.items():
            full = _own_parameters(module)[name]
            param.to_local().copy_(local_part(full.detach(), param, distribute_tensor))
            del full
    finally:
        for name, param in sharded.items():
            setattr(module, name, param)


def local_part(full: torch.Tensor, param: torch.Tensor, distribute_tensor: Any) -> torch.Tensor:
    """This rank's part of ``full`` laid out as the DTensor ``param``: a view (no copy) for Shard and
    Replicate placements (the chunking `Shard` uses); other placements through ``distribute_tensor``."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    order = list(range(len(placements)))
    if _fsdp_over_tp(placements, mesh, StridedShard, Shard):
        order.reverse()  # the tensor dimension's split first, then FSDP's shard of this rank's part of it
    elif coordinate is None or any(type(p) not in (Shard, Replicate) for p in placements):
        # src_data_rank=None: every rank slices its own part of the (identical) full tensor, no collective
        # (it may copy the whole tensor once more on the way: slower and larger than the views below)
        return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()  # type: ignore[no-any-return]
    assert coordinate is not None
    view = full
    for mesh_dim in order:
        placement = placements[mesh_dim]
        if isinstance(placement, (Shard, StridedShard)):  # _StridedShard is no Shard subclass
            pieces = torch.chunk(view, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            view = pieces[index] if index < len(pieces) else view.narrow(placement.dim, 0, 0)
    return view


def _fsdp_over_tp(placements: Any, mesh: Any, strided: Any, shard: Any) -> bool:
    """True for FSDP's layout of a layer that tensor parallelism split on the same dimension:
    ``(_StridedShard(d, split_factor=t), Shard(d))`` on a ``(shard, tensor)`` mesh of ``t`` tensor
    ranks. A rank's part is then chunk ``c_shard`` of chunk ``c_tensor`` of the full tensor."""
    if len(placements) != 2 or type(placements[0]) is not strided or type(placements[1]) is not shard:
        return False
    return bool(placements[0].dim == placements[1].dim and placements[0].split_factor == mesh.size(1))
