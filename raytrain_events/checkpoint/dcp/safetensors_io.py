"""Safetensors out and in: a checkpoint's model as a Hugging Face-style safetensors directory, and
such a directory loaded into a (sharded) model.

Why: Hugging Face, vLLM and most inference stacks read safetensors (a JSON header, then raw
little-endian tensor bytes; no pickle, so nothing in a file runs on load).

Export (`export_safetensors`) reads a sharded (DCP) checkpoint one tensor at a time through the
checkpoint's index and streams its bytes to the output: the shapes and dtypes come from the
index, so each file's header is written before any tensor is read; a tensor saved in dim-0 blocks
(FSDP) is copied block by block as raw bytes, from the block's place in the shard file straight
into the output file through one reused buffer of at most 8 MiB, so no tensor is built (measured
in tests/parallel: 236 KB above baseline for a 256 KiB largest tensor saved in 128 KiB blocks,
the block's buffer plus the checkpoint index and headers; the bound is one tensor + 64 KiB). Any other layout is assembled by the safe DCP reader into
one full tensor. Files are split
at ``max_shard_bytes`` as Hugging Face does (``model-00001-of-00002.safetensors`` plus
``model.safetensors.index.json``); one file is ``model.safetensors``. With ``hf_config`` (a
``config.json``) the directory is what ``from_pretrained`` loads, and the `HuggingFaceModel`
wrapper's ``model.`` prefix is dropped from the names.

Import (`load_safetensors`, and ``CheckpointConfig(load_from=<such a directory>)`` through
`start_from_safetensors`) fills a model's parameters and buffers from such a directory: a
DTensor (FSDP) parameter reads only its own rows (dim-0 shards are one byte range each), a plain
one reads its whole tensor. Any fsspec URL works (ranged reads).
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from raytrain_events.checkpoint.dcp.ranged_dcp import PROBE, parse_layout
from raytrain_events.checkpoint.dcp.sharded import is_sharded_checkpoint
from raytrain_events.checkpoint.format.reader import read_checkpoint_files
from raytrain_events.parallel.deferred_init import local_part
from raytrain_events.storage.fs import resolve
from raytrain_events.storage.run_dir import STATE_FILE

__all__ = ["export_safetensors", "is_safetensors_dir", "load_safetensors", "read_header", "start_from_safetensors"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
Spec = Tuple[str, Tuple[int, ...], torch.dtype]


def _nbytes(shape: Tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _header(specs: List[Spec]) -> bytes:
    entries: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _DTYPES:
            raise ValueError(
                f"{name}: dtype {dtype} has no safetensors name; convert it first (supported: {list(_DTYPES)})."
            )
        size = _nbytes(shape, dtype)
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


_CHUNK = 8 * 2**20  # bytes per write (and per read of a saved block): a buffered writer copies at most this


def _write_tensor(stream: Any, tensor: torch.Tensor) -> None:
    """The tensor's bytes, without a second copy when it is contiguous on the CPU; written in
    `_CHUNK` pieces, because a buffered fsspec writer (s3fs) copies whatever one write hands it."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    view = memoryview(flat.numpy())
    for start in range(0, len(view), _CHUNK):
        stream.write(view[start : start + _CHUNK])


def _block_bytes(stream: Any, info: Any, dtype: torch.dtype, shape: Tuple[int, ...]) -> Iterator[Any]:
    """One saved block (a ``torch.save`` record at ``info.offset`` of an open shard file): its raw
    bytes in `_CHUNK` pieces through one reused buffer, when the record is a plain contiguous
    little-endian tensor of ``shape`` and ``dtype`` (found from the record's zip directory and
    ``data.pkl``, decoded without running anything: `ranged_dcp.parse_layout`); otherwise the block
    as a tensor (``torch.load`` with ``weights_only``)."""
    stream.seek(info.offset)
    head = stream.read(min(PROBE, info.length))
    stream.seek(info.offset + max(info.length - PROBE, 0))
    tail = stream.read(min(PROBE, info.length))
    layout = parse_layout(info.length, head, tail)
    if layout is None or layout.dtype != dtype or layout.size != shape:
        stream.seek(info.offset)
        data = stream.read(info.length)
        block = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        del data
        yield block
        return
    left = _nbytes(shape, dtype)
    stream.seek(info.offset + layout.data_start + layout.storage_offset * torch.empty((), dtype=dtype).element_size())
    buffer = memoryview(bytearray(min(_CHUNK, left)))
    while left:
        piece = buffer[: min(len(buffer), left)]
        filled = 0
        while filled < len(piece):
            got = stream.readinto(piece[filled:])
            if not got:
                raise ValueError(f"{info.relative_path}: the saved block ends {left - filled} bytes early.")
            filled += got
        yield piece  # written before the next piece is read into the same buffer
        left -= len(piece)


def _plan_files(specs: List[Spec], max_shard_bytes: int) -> List[List[Spec]]:
    files: List[List[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec[1], spec[2])
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += nbytes
    return files


def write_safetensors_dir(
    fs: Any,
    directory: str,
    specs: List[Spec],
    read: Callable[[str], Iterable[Any]],
    *,
    rename: Callable[[str], str] = lambda name: name,
    max_shard_bytes: int = 5 * 2**30,
) -> Dict[str, Any]:
    """Write ``specs`` (names, shapes, dtypes) as safetensors files under ``directory``, calling
    ``read(name)`` for one tensor at a time: it yields the tensor, or its dim-0 blocks in order (as
    tensors, or as their raw bytes in pieces), each dropped once written; returns a summary."""
    fs.makedirs(directory, exist_ok=True)
    files = _plan_files(specs, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    weight_map, total = {}, 0
    for file_name, file_specs in zip(names, files):
        renamed = [(rename(n), s, d) for n, s, d in file_specs]
        with fs.open(f"{directory}/{file_name}", "wb") as stream:
            stream.write(_header(renamed))
            for (name, shape, dtype), (out_name, _, _) in zip(file_specs, renamed):
                written = 0
                for piece in read(name):  # the tensor, its row blocks in order, or raw bytes of them
                    if isinstance(piece, torch.Tensor):
                        if piece.dtype != dtype:
                            raise ValueError(f"{name}: read {piece.dtype}, expected {dtype}.")
                        _write_tensor(stream, piece)
                        written += piece.numel() * piece.element_size()
                    else:
                        stream.write(piece)
                        written += len(piece)
                    del piece
                if written != _nbytes(shape, dtype):
                    raise ValueError(
                        f"{name}: read {written} bytes, expected {_nbytes(shape, dtype)} ({shape} {dtype})."
                    )
                weight_map[out_name] = file_name
                total += _nbytes(shape, dtype)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with fs.open(f"{directory}/{INDEX_FILE}", "w") as stream:
            json.dump(index, stream, indent=2)
    return {"files": names, "tensors": len(specs), "bytes": total}


def _dim0_blocks(metadata: Any, key: str, item: Any) -> Optional[List[Any]]:
    """The storage and row count of each saved block of tensor ``key`` in row order, if its blocks tile dim 0 (FSDP's
    layout) and are stored untransformed; else None."""
    from torch.distributed.checkpoint.metadata import MetadataIndex  # deferred: DCP loads for sharded checkpoints only

    size = tuple(item.size)
    chunks = sorted(item.chunks, key=lambda c: tuple(c.offsets))
    row = 0
    out = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if not size or offsets[0] != row or any(offsets[1:]) or sizes[1:] != size[1:]:
            return None
        info = metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        out.append((info, sizes[0]))
        row += sizes[0]
    return out if row == size[0] else None


def _dcp_model_tensors(url: str, options: Dict[str, Any]) -> Tuple[List[Spec], Callable[[str], Iterable[Any]]]:
    """The model tensors of a sharded checkpoint (names, shapes, dtypes) and a one-tensor reader.

    A tensor saved in dim-0 blocks (FSDP's layout) is streamed block by block straight from the
    shard files as raw bytes (`_block_bytes`; a block whose record is not a plain tensor is read
    with ``torch.load(weights_only=True)``). Other layouts go through DCP into one full tensor.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # why here: both import torch.distributed.checkpoint (~0.7 s), for sharded checkpoints only
    from raytrain_events._torch_compat import load_whole_state_dict
    from raytrain_events.checkpoint.dcp.safe_dcp import SafeDCPReader, SafeLoadPlanner

    class _Reader(SafeDCPReader):  # the index is unpickled (safely) once, not once per tensor
        _cached: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._cached is None:
                self._cached = super().read_metadata(*args, **kwargs)
            return self._cached

    reader = _Reader(url, **options)
    metadata = reader.read_metadata()
    items = {
        key[len("model.") :]: (key, item)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    specs = [(name, tuple(item.size), item.properties.dtype) for name, (_, item) in items.items()]
    fs, root = resolve(url, options)
    root = root.rstrip("/")

    def read(name: str) -> Iterator[Any]:
        key, item = items[name]
        storages = _dim0_blocks(metadata, key, item)
        if storages is None:  # another layout: DCP assembles the full tensor
            target = {"model": {name: torch.empty(tuple(item.size), dtype=item.properties.dtype)}}
            planner = SafeLoadPlanner(allow_partial_load=True)
            load_whole_state_dict(target, storage_reader=reader, planner=planner, no_dist=True)
            yield target["model"][name]
            return
        dtype, rest = item.properties.dtype, tuple(item.size)[1:]
        for info, rows in storages:
            with fs.open(f"{root}/{info.relative_path}", "rb") as stream:
                yield from _block_bytes(stream, info, dtype, (rows, *rest))

    return specs, read


def export_safetensors(
    info: Any,
    output_dir: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    hf_config: Optional[str] = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Dict[str, Any]:
    """The model of checkpoint ``info`` (a `CheckpointInfo`) as safetensors under ``output_dir``."""
    options = dict(storage_options or {})
    if is_sharded_checkpoint(info):
        specs, read = _dcp_model_tensors(info.url, options)
    else:  # a full checkpoint: state.pt already holds the whole model
        model = read_checkpoint_files(info, storage_options=options, files=[STATE_FILE]).files[STATE_FILE]["model"]
        specs = [(k, tuple(v.shape), v.dtype) for k, v in model.items()]

        def read(name: str) -> Iterator[torch.Tensor]:
            yield model[name]

    config = None
    if hf_config is not None:
        config_fs, config_path = resolve(hf_config, options)
        with config_fs.open(config_path, "rb") as stream:
            config = stream.read()
        json.loads(config)  # a clear error now rather than a broken directory later
    prefix = "model." if config is not None and specs and all(n.startswith("model.") for n, _, _ in specs) else ""
    fs, directory = resolve(output_dir, options)
    summary = write_safetensors_dir(
        fs, directory.rstrip("/"), specs, read, rename=lambda n: n[len(prefix) :], max_shard_bytes=max_shard_bytes
    )
    if config is not None:
        with fs.open(f"{directory.rstrip('/')}/config.json", "wb") as stream:
            stream.write(config)
    return {"source": info.url, "output": output_dir, **summary}


def read_header(fs: Any, path: str) -> Tuple[Dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    with fs.open(path, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        if length > 100 * 2**20:
            raise ValueError(f"{path}: header of {length} bytes; this is not a safetensors file.")
        header = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def _files_of(fs: Any, directory: str) -> Iterator[str]:
    if fs.exists(f"{directory}/{INDEX_FILE}"):
        with fs.open(f"{directory}/{INDEX_FILE}", "r") as stream:
            yield from sorted(set(json.load(stream)["weight_map"].values()))
    elif fs.exists(f"{directory}/model.safetensors"):
        yield "model.safetensors"
    else:
        raise FileNotFoundError(
            f"{directory} has neither model.safetensors nor {INDEX_FILE}. Fix: point at a safetensors export "
            "directory (raytrain-events export --format safetensors)."
        )


def load_safetensors(
    model: torch.nn.Module, url: str, *, storage_options: Optional[Dict[str, Any]] = None, strict: bool = True
) -> List[str]:
    """Fill ``model``'s parameters and buffers from the safetensors directory ``url``; each rank
    reads only its own rows of a dim-0-sharded (FSDP) tensor. Returns the names loaded."""
    fs, directory = resolve(url, dict(storage_options or {}))
    directory = directory.rstrip("/")
    where: Dict[str, Tuple[str, Dict[str, Any], int]] = {}
    for file_name in _files_of(fs, directory):
        header, start = read_header(fs, f"{directory}/{file_name}")
        for name, entry in header.items():
            where[name] = (f"{directory}/{file_name}", entry, start)
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    missing = sorted(set(targets) - set(where))
    if strict and missing:
        raise KeyError(
            f"{url} lacks {len(missing)} of the model's tensors, e.g. {missing[:5]}; pass strict=False to skip."
        )
    loaded = []
    with torch.no_grad():
        for name, target in targets.items():
            if name not in where:
                continue
            path, entry, start = where[name]
            if tuple(entry["shape"]) != tuple(target.shape):
                raise ValueError(f"{name}: {url} has shape {entry['shape']}, the model {tuple(target.shape)}.")
            _fill(fs, path, entry, start, target)
            loaded.append(name)
    return loaded


def _fill(fs: Any, path: str, entry: Dict[str, Any], start: int, target: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, Shard

    dtype = _FROM_NAME[entry["dtype"]]
    shape = tuple(entry["shape"])
    begin, end = entry["data_offsets"]
    rows, row_bytes = (shape[0], (end - begin) // shape[0]) if shape and shape[0] else (1, end - begin)
    first, count, local = 0, rows, target
    if isinstance(target, DTensor):
        local = target.to_local()
        placements, mesh = target.placements, target.device_mesh
        if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0 and shape:
            pieces = torch.chunk(torch.empty(rows, device="meta"), mesh.size(0))
            coordinate = mesh.get_coordinate()  # None only on a rank outside the mesh, which holds no shard
            index = coordinate[0] if coordinate is not None else len(pieces)
            first = sum(p.shape[0] for p in pieces[:index])
            count = pieces[index].shape[0] if index < len(pieces) else 0
        else:  # another layout: read the whole tensor (one tensor in memory), keep this rank's part
            from torch.distributed.tensor import distribute_tensor

            full = _read_rows(fs, path, start + begin, 0, rows, row_bytes, dtype, shape)
            local.copy_(local_part(full, target, distribute_tensor))
            return
    if count:
        local.copy_(_read_rows(fs, path, start + begin, first, count, row_bytes, dtype, shape))


def _read_rows(
    fs: Any, path: str, offset: int, first: int, count: int, row_bytes: int, dtype: torch.dtype, shape: Tuple[int, ...]
) -> torch.Tensor:
    with fs.open(path, "rb") as stream:
        stream.seek(offset + first * row_bytes)
        data = bytearray(stream.read(count * row_bytes))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape((count, *shape[1:]) if shape else ())


def is_safetensors_dir(url: str, storage_options: Optional[Dict[str, Any]] = None) -> bool:
    """True if ``url`` is a safetensors directory (``model.safetensors`` or the index) rather than a checkpoint."""
    fs, directory = resolve(url, dict(storage_options or {}))
    directory = directory.rstrip("/")
    return bool(fs.exists(f"{directory}/model.safetensors") or fs.exists(f"{directory}/{INDEX_FILE}"))


def start_from_safetensors(model: torch.nn.Module, config: Any) -> List[str]:
    """``load_from`` naming a safetensors directory: the model's weights only (the directory holds
    nothing else: optimizer, Timestamp and RNG start fresh). Each rank reads its own rows of a
    sharded parameter (`load_safetensors`), so a model built on the meta device and sharded is filled
    without a full copy anywhere. ``load_strict`` applies; ``load_ignore_keys`` is refused."""
    if config.load_ignore_keys:
        raise ValueError(
            f"load_ignore_keys={list(config.load_ignore_keys)!r} with load_from={config.load_from!r}, a safetensors "
            "directory: it holds model weights only. Fix: drop load_ignore_keys and pass load_strict=False to "
            "start the tensors it lacks from the model's own initialisation."
        )
    return load_safetensors(model, config.load_from, storage_options=config.storage_options, strict=config.load_strict)
