"""checkpoint/format.py: round trip, manifest-last commit, integrity and unpickling safety.

These test the multi-file layout (``pack=False``); the packed one is in test_checkpoint_packed.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
import zlib

import pytest
import torch

from raytrain_events.checkpoint.folder.store import latest_checkpoint, list_checkpoints, load_latest_valid
from raytrain_events.checkpoint.format import manifest as fmt_manifest
from raytrain_events.checkpoint.format import reader as fmt_reader
from raytrain_events.checkpoint.format import writer as fmt_writer
from raytrain_events.storage import fs as sfs


def _tree() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b": torch.tensor([float("nan"), -0.0]),
            "half": torch.randn(5, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "step": torch.tensor(7),
            "mask": torch.tensor([True, False]),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:],
        },
        "scalars": [1, 2.5, "text", None, True, (3, "tuple")],
        "nested": {"deep": [{"x": torch.zeros(0)}]},
    }


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _assert_identical(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_identical(x, y)
    else:
        assert a == b


def _save(url, opts, batch: int, **kw) -> fmt_manifest.CheckpointInfo:
    files = kw.pop("files", {"state.pt": {"batch": batch, "t": torch.full((3,), float(batch))}})
    return fmt_writer.write_checkpoint(
        url,
        files=files,
        timestamp={"epoch": 0, "batch": batch},
        world_size=1,
        metadata=kw.pop("metadata", {}),
        storage_options=opts,
        pack=kw.pop("pack", False),
        **kw,
    )


@pytest.mark.parametrize("pack", [False, True])
def test_round_trip_is_bit_identical(storage, pack):
    url, opts = storage
    tree = _tree()
    info = fmt_writer.write_checkpoint(
        url,
        files={"state.pt": tree, "rng-rank0.pt": {"seed": 3}},
        timestamp={"epoch": 2, "batch": 123},
        world_size=1,
        metadata={"note": "hi", "lr": [0.1]},
        storage_options=opts,
        pack=pack,
    )
    assert fmt_manifest.CHECKPOINT_NAME_RE.match(info.name) and info.name.startswith("ckpt-000000000123-")
    loaded = fmt_reader.read_checkpoint(info.url, storage_options=opts)
    _assert_identical(loaded.files["state.pt"], tree)
    assert loaded.files["rng-rank0.pt"] == {"seed": 3}
    assert loaded.info == info
    assert info.timestamp == {"epoch": 2, "batch": 123}
    assert info.metadata == {"note": "hi", "lr": [0.1]}
    assert info.packed == pack and fmt_manifest.FORMAT_VERSION == 4
    assert info.format_version == (3 if pack else 4)  # packed: 3; multi-file with crc32 records: 4
    assert all(len(f.crc32) == 8 and f.sha256 == "" and f.checksum == ("crc32", f.crc32) for f in info.files)
    assert {f.name for f in info.files} == {"state.pt", "rng-rank0.pt"}


def test_manifest_is_written_last(storage, monkeypatch):
    url, opts = storage
    order: list[str] = []
    real_upload, real_create = fmt_writer._upload, fmt_writer.write_bytes_create_only
    monkeypatch.setattr(fmt_writer, "_upload", lambda fs, p, d: (order.append(p), real_upload(fs, p, d)))
    monkeypatch.setattr(
        fmt_writer, "write_bytes_create_only", lambda fs, p, d, **kw: (order.append(p), real_create(fs, p, d, **kw))
    )
    _save(url, opts, 1, files={"a.pt": 1, "b.pt": 2, "c.pt": 3})
    assert [sfs.basename(p) for p in order] == ["a.pt", "b.pt", "c.pt", fmt_manifest.MANIFEST]


def test_uncommitted_directory_is_ignored(storage):
    url, opts = storage
    good = _save(url, opts, 10)
    pending = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 20})
    fmt_writer.write_checkpoint_file(pending, "state.pt", {"x": torch.ones(2)}, storage_options=opts)
    assert [c.name for c in list_checkpoints(url, storage_options=opts)] == [good.name]
    assert latest_checkpoint(url, storage_options=opts).name == good.name
    with pytest.raises(fmt_manifest.CheckpointNotCommittedError, match="never committed"):
        fmt_reader.read_checkpoint(pending, storage_options=opts)


def test_rank_files_are_committed_by_rank_zero(storage):
    url, opts = storage
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 5})
    # each "rank" uploads its own RNG file and hands the entry to rank 0
    entries = [
        fmt_writer.write_checkpoint_file(ckpt, fmt_writer.rng_file_name(r), {"rank": r}, storage_options=opts)
        for r in (1, 0)
    ]
    entries.append(fmt_writer.write_checkpoint_file(ckpt, "state.pt", {"w": torch.ones(1)}, storage_options=opts))
    info = fmt_writer.commit_checkpoint(
        ckpt, entries=entries, timestamp={"batch": 5}, world_size=2, storage_options=opts
    )
    assert [f.name for f in info.files] == ["rng-rank0.pt", "rng-rank1.pt", "state.pt"]
    only = fmt_reader.read_checkpoint(ckpt, storage_options=opts, files=["rng-rank1.pt"])
    assert only.files == {"rng-rank1.pt": {"rank": 1}}
    with pytest.raises(fmt_manifest.CheckpointError, match="already committed"):
        fmt_writer.commit_checkpoint(ckpt, entries=entries, timestamp={"batch": 5}, world_size=2, storage_options=opts)


def test_commit_refuses_when_a_rank_file_is_missing(storage):
    url, opts = storage
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 5})
    e0 = fmt_writer.write_checkpoint_file(ckpt, "rng-rank0.pt", 0, storage_options=opts)
    ghost = fmt_manifest.FileEntry("rng-rank1.pt", 10, "0" * 64)
    with pytest.raises(fmt_manifest.CheckpointError, match="rng-rank1.pt"):
        fmt_writer.commit_checkpoint(
            ckpt, entries=[e0, ghost], timestamp={"batch": 5}, world_size=2, storage_options=opts
        )
    assert list_checkpoints(url, storage_options=opts) == []


def test_corrupted_byte_is_detected_and_load_latest_valid_falls_back(storage, caplog):
    url, opts = storage
    older = _save(url, opts, 1)
    newer = _save(url, opts, 2)
    fs, path = sfs.resolve(sfs.join(newer.url, "state.pt"), opts)
    data = bytearray(sfs.read_bytes(fs, path))
    data[len(data) // 2] ^= 0x01
    sfs.write_bytes_atomic(fs, path, bytes(data))
    with pytest.raises(fmt_manifest.CheckpointCorruptError) as e:
        fmt_reader.read_checkpoint(newer.url, storage_options=opts)
    entry = newer.files[0]
    assert "state.pt" in str(e.value) and f"expected {entry.size} bytes with crc32 {entry.crc32}" in str(e.value)
    assert f"crc32 {zlib.crc32(bytes(data)):08x}" in str(e.value)
    loaded = load_latest_valid(url, storage_options=opts)
    assert loaded is not None and loaded.info.name == older.name
    assert loaded.files["state.pt"]["batch"] == 1
    assert any(newer.name in r.getMessage() for r in caplog.records)


def _commit_files(url, opts, batch, files: dict, record) -> str:
    """A multi-file checkpoint built from known bytes, its records made by ``record(name, data)``."""
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": batch})
    for name, data in files.items():
        fs, path = sfs.resolve(sfs.join(ckpt, name), opts)
        sfs.write_bytes_atomic(fs, path, data)
    entries = [record(name, data) for name, data in files.items()]
    fmt_writer.commit_checkpoint(ckpt, entries=entries, timestamp={"batch": batch}, world_size=1, storage_options=opts)
    return ckpt


def test_format_version_1_multi_file_checkpoint_still_loads_and_is_verified(storage):
    """Checkpoints written before the CRC32 records (sha256 per file, format_version 1) load,
    and a flipped byte in them is still caught, by their sha256."""
    url, opts = storage
    data = fmt_writer.serialize({"w": torch.arange(300_000, dtype=torch.float32)})  # > 1 MiB: the mmap path locally
    ckpt = _commit_files(
        url, opts, 1, {"state.pt": data}, lambda n, d: fmt_manifest.FileEntry(n, len(d), hashlib.sha256(d).hexdigest())
    )
    info = fmt_reader.read_checkpoint(ckpt, storage_options=opts).info
    assert info.format_version == 1 and info.files[0].checksum == ("sha256", hashlib.sha256(data).hexdigest())
    assert torch.equal(
        fmt_reader.read_checkpoint(ckpt, storage_options=opts).files["state.pt"]["w"], torch.arange(300_000.0)
    )
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x01
    fs, path = sfs.resolve(sfs.join(ckpt, "state.pt"), opts)
    sfs.write_bytes_atomic(fs, path, bytes(bad))
    with pytest.raises(
        fmt_manifest.CheckpointCorruptError, match=f"with sha256 {hashlib.sha256(bytes(bad)).hexdigest()}"
    ):
        fmt_reader.read_checkpoint(ckpt, storage_options=opts)


def test_a_manifest_may_mix_crc32_and_sha256_records(storage):
    """Entries a caller made with hashlib (sha256) beside ours (CRC32): version 4, each record
    verified by its own checksum; a malformed crc32 is refused."""
    url, opts = storage
    rng, shard = fmt_writer.serialize({"seed": 1}), b"dcp shard bytes"
    ckpt = _commit_files(
        url,
        opts,
        1,
        {"rng-rank0.pt": rng, "__0_0.distcp": shard},
        lambda n, d: (
            fmt_manifest.FileEntry(n, len(d), "", crc32=f"{zlib.crc32(d):08x}")
            if n.endswith(".pt")
            else fmt_manifest.FileEntry(n, len(d), hashlib.sha256(d).hexdigest())
        ),
    )
    loaded = fmt_reader.read_checkpoint(ckpt, files=["rng-rank0.pt"], storage_options=opts)
    assert loaded.info.format_version == 4 and loaded.files["rng-rank0.pt"] == {"seed": 1}
    assert {f.name: f.checksum[0] for f in loaded.info.files} == {"rng-rank0.pt": "crc32", "__0_0.distcp": "sha256"}
    fs, path = sfs.resolve(sfs.join(ckpt, fmt_manifest.MANIFEST), opts)
    manifest = json.loads(sfs.read_bytes(fs, path))
    manifest["files"][1]["crc32"] = "XYZ"
    sfs.write_bytes_atomic(fs, path, json.dumps(manifest).encode())
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match="crc32 of 'rng-rank0.pt' is 'XYZ'"):
        fmt_reader.read_checkpoint(ckpt, storage_options=opts)


def test_truncated_file_is_corrupt(storage):
    url, opts = storage
    info = _save(url, opts, 3)
    fs, path = sfs.resolve(sfs.join(info.url, "state.pt"), opts)
    sfs.write_bytes_atomic(fs, path, sfs.read_bytes(fs, path)[:-7])
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match="got"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)
    assert load_latest_valid(url, storage_options=opts) is None


def test_newer_format_version_names_both_versions(storage):
    url, opts = storage
    info = _save(url, opts, 1)
    fs, path = sfs.resolve(sfs.join(info.url, fmt_manifest.MANIFEST), opts)
    manifest = json.loads(sfs.read_bytes(fs, path))
    manifest["format_version"] = 99
    sfs.write_bytes_atomic(fs, path, json.dumps(manifest).encode())
    with pytest.raises(fmt_manifest.UnsupportedCheckpointVersionError, match=r"99.*1\.\.4.*upgrade"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)
    with pytest.raises(fmt_manifest.UnsupportedCheckpointVersionError):  # no silent fallback to older
        load_latest_valid(url, storage_options=opts)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_bytes(kind: str, marker: str) -> bytes:
    payload = {"model": {"w": torch.ones(1)}, "x": _Evil(marker)}
    return fmt_writer.serialize(payload) if kind == "torch.save" else pickle.dumps(payload, protocol=2)


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_malicious_pickle_with_correct_checksum_is_refused(storage, kind, tmp_path):
    url, opts = storage
    marker = f"/tmp/pwned-{uuid.uuid4().hex}"
    data = _evil_bytes(kind, marker)
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 1})
    fs, path = sfs.resolve(sfs.join(ckpt, "state.pt"), opts)
    sfs.write_bytes_atomic(fs, path, data)
    entry = fmt_manifest.FileEntry("state.pt", len(data), hashlib.sha256(data).hexdigest())
    fmt_writer.commit_checkpoint(
        ckpt, entries=[entry], timestamp={"batch": 1}, world_size=1, storage_options=opts
    )  # the attacker rewrote the manifest too
    try:
        with pytest.raises(fmt_manifest.UnsafeCheckpointError) as e:
            fmt_reader.read_checkpoint(ckpt, storage_options=opts)
        msg = str(e.value)
        assert "state.pt" in msg and "Nothing in the file was executed" in msg
        assert "weights_only=False" in msg
        with pytest.raises(fmt_manifest.UnsafeCheckpointError):  # not silently skipped either
            load_latest_valid(url, storage_options=opts)
        assert not os.path.exists(marker)
        # positive control: the payload really does run code under a plain unpickler
        control = str(tmp_path / "control")
        pickle.loads(pickle.dumps(_Evil(control), protocol=2))
        assert os.path.exists(control)
    finally:
        if os.path.exists(marker):
            os.remove(marker)


def test_invalid_inputs_are_rejected_with_fixes(storage):
    url, opts = storage
    with pytest.raises(TypeError, match="plain int"):
        fmt_writer.write_checkpoint(
            url, files={"a.pt": 1}, timestamp={"batch": torch.tensor(3)}, world_size=1, storage_options=opts
        )
    with pytest.raises(TypeError, match="JSON"):
        _save(url, opts, 1, metadata={"bad": object()})
    with pytest.raises(ValueError, match="no '/'"):
        _save(url, opts, 1, files={"../escape.pt": 1})
    with pytest.raises(ValueError):
        _save(url, opts, 1, files={fmt_manifest.MANIFEST: 1})
    assert list_checkpoints(url, storage_options=opts) == []
