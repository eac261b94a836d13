"""Every private torch name this package uses, in one place (the torch counterpart of `raytrain_events.ray._compat`).

torch may rename or move a private name in any release. Each one is reached here, by the public
name on the left, and resolved when first asked for; a missing one raises `TorchCompatError`
naming the torch version and the name instead of an ImportError deep inside a checkpoint save.
`check_private_names()` probes them all; tests/test_torch_compat.py runs it, so a torch upgrade
that removes one fails one test loudly.

Private names used (checked against torch 2.13.0):

* ``torch.distributed.checkpoint._fsspec_filesystem`` ``FsspecReader``, ``FsspecWriter``,
  ``FileSystem``: DCP over fsspec (s3://, memory://), which the safe reader/writer subclass.
* ``torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner``: DCP's planner that
  loads a whole checkpoint without a template (the safe full loader subclasses it).
* ``torch.distributed.checkpoint.filesystem._StorageInfo`` and ``torch.serialization._get_layout``:
  classes a DCP ``.metadata`` pickle names, allowed by the safe unpickler.
* ``torch.distributed.checkpoint._nested_dict.set_element``: DCP's own way to put a loaded value
  back into a nested state dict.
* ``torch.distributed._state_dict_utils._create_cpu_state_dict`` / ``_copy_state_dict``: a CPU
  (pinned) staging copy of a state dict with DTensor shards kept, as DCP's async save stages it.
* ``torch.distributed.checkpoint.state_dict_loader._load_state_dict``: load every key of a
  checkpoint into an empty dict (what DCP's ``dcp_to_torch_save`` calls).
* ``torch.distributed._composable.checkpoint``: per-module activation checkpointing for FSDP2.
* ``torch._foreach_lerp_``: EMA's one fused update over all parameters.
* ``torch.utils._pytree.tree_flatten``: the tensors of a forward's inputs, whatever their nesting
  (tensor parallelism's check that a tensor group sees one batch).
* ``torch.distributed.tensor.placement_types._StridedShard``: the placement FSDP gives a layer that
  tensor parallelism already split (deferred init cuts a rank's part of it as a view).
* ``torch.distributed.device_mesh.DeviceMesh._flatten``: one process group over several mesh
  dimensions: the data-parallel ranks of HSDP x TP (for metrics) and FSDP's ``shard x context``
  under context parallelism (as torchtitan's ``dp_shard_cp``). torch 2.13 warns that slicing a
  flattened dimension from the root mesh (HSDP x CP's ``mesh["replicate", "shard_context"]``)
  "will be deprecated"; it works here.

Undocumented members of DCP's fsspec classes, used by the safe reader and writer
(checkpoint/dcp/safe_dcp.py) and probed on instances by `check_private_names` (`MEMBERS`): a reader's
``fs`` (DCP's ``FileSystem``), ``path`` and ``storage_data`` (set by ``set_up_storage_reader``);
a writer's ``fs``; the ``FileSystem``'s ``fs`` (the fsspec filesystem), ``create_stream`` and
``concat_path``.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Tuple

#: public name here -> (module, private attribute)
NAMES: Dict[str, Tuple[str, str]] = {
    "FsspecReader": ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader"),
    "FsspecWriter": ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),
    "FsspecFileSystem": ("torch.distributed.checkpoint._fsspec_filesystem", "FileSystem"),
    "EmptyStateDictLoadPlanner": ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
    "StorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    "get_layout": ("torch.serialization", "_get_layout"),
    "set_element": ("torch.distributed.checkpoint._nested_dict", "set_element"),
    "create_cpu_state_dict": ("torch.distributed._state_dict_utils", "_create_cpu_state_dict"),
    "copy_state_dict": ("torch.distributed._state_dict_utils", "_copy_state_dict"),
    "load_whole_state_dict": ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    "activation_checkpoint": ("torch.distributed._composable", "checkpoint"),
    "foreach_lerp_": ("torch", "_foreach_lerp_"),
    "tree_flatten": ("torch.utils._pytree", "tree_flatten"),
    # FSDP over tensor parallelism lays a split layer's rows out as (_StridedShard, Shard): deferred init
    # slices a rank's part of a full layer as a view for it (parallel/deferred_init.py `local_part`).
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),
    # The autograd engine, whose queue_callback runs a function at the end of the current backward
    # (parallel/oom_agreement.py: an OOM check ahead of FSDP's own final callback, queued the same way).
    "autograd_engine": ("torch.autograd.variable", "Variable._execution_engine"),
    # One process group over several mesh dimensions (HSDP x TP's data-parallel ranks: metrics sync
    # over replicate x shard, parallel/tensor_parallel.py `metric_group`; FSDP over shard x context
    # under context parallelism, parallel/wrap.py `fsdp_mesh`).
    "flatten_mesh": ("torch.distributed.device_mesh", "DeviceMesh._flatten"),
}
__all__ = ["TorchCompatError", "NAMES", "MEMBERS", "check_private_names", *NAMES]


class TorchCompatError(ImportError):
    """A private torch name this package relies on is gone (a torch upgrade changed it)."""


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def resolve(module: str, attr: str) -> Any:
    """``module.attr``, or `TorchCompatError` naming the torch version and the missing name."""
    try:
        value = importlib.import_module(module)
        for part in attr.split("."):  # a dotted attribute: a class's private member
            value = getattr(value, part)
        return value
    except (ImportError, AttributeError) as exc:
        raise TorchCompatError(
            f"torch {_torch_version()} has no {module}.{attr} ({type(exc).__name__}: {exc}). raytrain_events "
            "relies on it (see raytrain_events/_torch_compat.py, checked against torch 2.13.0): install a torch "
            "version it supports, or update raytrain_events._torch_compat for this one."
        ) from exc


def __getattr__(name: str) -> Any:
    """``from raytrain_events._torch_compat import FsspecReader``: resolved on first use, then cached."""
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(*NAMES[name])
    globals()[name] = value
    return value


#: class (a public name above) -> undocumented members of its instances that this package uses
MEMBERS: Dict[str, Tuple[str, ...]] = {
    "FsspecReader": ("fs", "path", "storage_data"),
    "FsspecWriter": ("fs",),
    "FsspecFileSystem": ("fs", "create_stream", "concat_path"),
}


def _probe_instances() -> Dict[str, Any]:
    """A reader (set up with empty metadata), a writer and the reader's FileSystem, on ``memory://``."""
    from torch.distributed.checkpoint.metadata import Metadata

    reader = resolve(*NAMES["FsspecReader"])("memory://raytrain-events-torch-compat-probe")
    reader.set_up_storage_reader(Metadata(state_dict_metadata={}, storage_data={}), True)
    writer = resolve(*NAMES["FsspecWriter"])("memory://raytrain-events-torch-compat-probe")
    return {"FsspecReader": reader, "FsspecWriter": writer, "FsspecFileSystem": getattr(reader, "fs", None)}


def check_private_names() -> List[Tuple[str, str]]:
    """Probe every name above and the `MEMBERS` of their instances; return ``(name, problem)`` for
    each one that is gone."""
    problems: List[Tuple[str, str]] = []
    for name, (module, attr) in NAMES.items():
        try:
            resolve(module, attr)
        except TorchCompatError as exc:
            problems.append((name, str(exc)))
    if problems:
        return problems
    instances = _probe_instances()
    for name, members in MEMBERS.items():
        for member in members:
            if not hasattr(instances[name], member):
                problems.append(
                    (
                        f"{name}.{member}",
                        f"torch {_torch_version()}'s {name} instances have no {member!r}; the safe DCP reader/writer "
                        "(checkpoint/dcp/safe_dcp.py) use it: install a torch version raytrain_events supports, or "
                        "update raytrain_events._torch_compat.MEMBERS and safe_dcp for this one.",
                    )
                )
    return problems
