"""checkpoint/format/packed.py: one object (manifest + payloads) written with one create-only request.

Real local files, memory:// and a real S3 API (moto on 127.0.0.1) via the ``storage`` fixture.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import uuid
import zipfile
import zlib

import pytest
import torch

from raytrain_events.checkpoint.folder.index import CheckpointIndex
from raytrain_events.checkpoint.folder.store import (
    latest_checkpoint,
    list_checkpoints,
    load_latest_valid,
    prune_checkpoints,
)
from raytrain_events.checkpoint.format import checksums, packed
from raytrain_events.checkpoint.format import manifest as fmt_manifest
from raytrain_events.checkpoint.format import reader as fmt_reader
from raytrain_events.checkpoint.format import writer as fmt_writer
from raytrain_events.storage import fs as sfs


def _state(batch: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    return {"batch": batch, "w": torch.randn(64, 33, generator=g), "b": torch.arange(5).to(torch.bfloat16)}


def _save(url, opts, batch: int, **kw) -> fmt_manifest.CheckpointInfo:
    files = kw.pop("files", {"rng-rank0.pt": {"seed": batch}, "state.pt": _state(batch)})
    return fmt_writer.write_checkpoint(
        url,
        files=files,
        timestamp={"epoch": 0, "batch": batch},
        world_size=1,
        metadata={"note": "packed", "cfg": {"lr": 0.1}},
        storage_options=opts,
        pack=kw.pop("pack", True),
        **kw,
    )


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _manifest(opts, info) -> tuple:
    fs, path = sfs.resolve(sfs.join(info.url, fmt_manifest.MANIFEST), opts)
    return fs, path, sfs.read_bytes(fs, path)


def test_round_trip_is_one_object_in_the_checkpoint_directory(storage):
    url, opts = storage
    info = _save(url, opts, 7)
    assert info.packed and info.format_version == 3 and [f.name for f in info.files] == ["rng-rank0.pt", "state.pt"]
    loaded = fmt_reader.read_checkpoint(info.url, storage_options=opts)
    assert loaded.info == info
    assert _same(loaded.files["state.pt"], _state(7)) and loaded.files["rng-rank0.pt"] == {"seed": 7}
    only = fmt_reader.read_checkpoint(info.url, storage_options=opts, files=["rng-rank0.pt"])
    assert only.files == {"rng-rank0.pt": {"seed": 7}}
    assert fmt_reader.read_manifest(info.url, storage_options=opts) == info
    # still a directory (what Ray Train registers), holding only the commit object
    fs, path, raw = _manifest(opts, info)
    ckpt_dir = sfs.resolve(info.url, opts)[1]
    assert fs.isdir(ckpt_dir) and [sfs.basename(e["name"]) for e in sfs.list_dir(fs, ckpt_dir)] == [
        fmt_manifest.MANIFEST
    ]
    # its first line is the manifest as JSON; the payloads follow, as torch.save wrote them
    header = json.loads(raw.split(b"\n", 1)[0])
    assert header["packed"] is True and header["format_version"] == 3 and header["metadata"]["note"] == "packed"
    start = raw.index(b"\n") + 1
    for f, record in zip(info.files, header["files"]):  # each file: its own crc32, no sha256 any more
        payload = raw[start + f.offset : start + f.offset + f.size]
        assert record == {"name": f.name, "size": f.size, "crc32": f"{zlib.crc32(payload):08x}", "offset": f.offset}
        assert f.crc32 == record["crc32"] and f.sha256 == "" and f.checksum == ("crc32", f.crc32)
    state = next(f for f in info.files if f.name == "state.pt")
    with checksums.torch_zip_crc_off():  # the payload is torch.save's bytes, serialized without zip CRCs
        assert raw[start + state.offset : start + state.offset + state.size] == fmt_writer.serialize(_state(7))
    assert len(raw) == info.packed_size


def test_listed_loaded_latest_and_pruned_with_multi_file_checkpoints(storage):
    url, opts = storage
    infos = [_save(url, opts, b, pack=b % 2 == 0) for b in (1, 2, 3, 4, 5)]
    listed = list_checkpoints(url, storage_options=opts)
    assert [c.name for c in listed] == [i.name for i in infos]
    assert [c.packed for c in listed] == [False, True, False, True, False]
    assert latest_checkpoint(url, storage_options=opts).name == infos[-1].name
    deleted = prune_checkpoints(url, keep=2, storage_options=opts)
    assert sorted(deleted) == sorted(i.url for i in infos[:3])
    fs, root = sfs.resolve(url, opts)
    dirs = [e for e in sfs.list_dir(fs, root) if e.get("type") == "directory"]
    assert sorted(sfs.basename(e["name"]) for e in dirs) == sorted(i.name for i in infos[3:])
    latest = load_latest_valid(url, storage_options=opts)  # the listing read only a range of each
    assert latest.info.name == infos[-1].name and _same(latest.files["state.pt"], _state(5))
    older = fmt_reader.read_checkpoint_files(listed[3], storage_options=opts)  # packed, from the listing
    assert _same(older.files["state.pt"], _state(4))


def test_failed_single_put_leaves_previous_latest(storage, monkeypatch):
    url, opts = storage
    good = _save(url, opts, 100)
    calls = []

    def dead(fs, path, data, **kw):
        calls.append(path)
        raise ConnectionError("injected: network died during the one PUT")

    monkeypatch.setattr(fmt_writer, "write_bytes_create_only", dead)
    with pytest.raises(ConnectionError, match="injected"):
        _save(url, opts, 200)
    monkeypatch.undo()
    assert len(calls) == 1 and calls[0].endswith(fmt_manifest.MANIFEST)
    assert latest_checkpoint(url, storage_options=opts).name == good.name
    loaded = load_latest_valid(url, storage_options=opts)
    assert loaded.info.name == good.name and loaded.files["state.pt"]["batch"] == 100


def test_failed_put_on_s3_leaves_nothing(s3_server, monkeypatch):
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    opts = s3_server["storage_options"]
    good = _save(url, opts, 1)
    fs, root = sfs.resolve(url, opts)
    real = fs._call_s3

    async def failing(method, *a, **k):
        if method == "put_object":
            raise ConnectionResetError("injected: connection reset while sending the body")
        return await real(method, *a, **k)

    monkeypatch.setattr(fs, "_call_s3", failing)
    monkeypatch.setattr(fs, "retries", 1)
    with pytest.raises(Exception, match="injected"):
        _save(url, opts, 2)
    monkeypatch.undo()
    assert [sfs.basename(e["name"]) for e in sfs.list_dir(fs, root)] == [good.name]  # no half checkpoint at all
    assert load_latest_valid(url, storage_options=opts).info.name == good.name


@pytest.mark.parametrize("damage", ["truncated", "appended", "bit flip", "header cut"])
def test_damaged_packed_file_is_refused_naming_it(storage, damage, caplog):
    url, opts = storage
    older = _save(url, opts, 1)
    newer = _save(url, opts, 2)
    fs, path, raw = _manifest(opts, newer)
    data = bytearray(raw)
    if damage == "truncated":
        data = data[:-7]
    elif damage == "appended":
        data += b"\0"
    elif damage == "bit flip":
        data[-100] ^= 0x01
    else:
        data = data[: raw.index(b"\n") // 2]
    fs.rm(path)  # create-only objects are never rewritten by the library; an attacker/bit rot can
    sfs.write_bytes_atomic(fs, path, bytes(data))
    with pytest.raises(fmt_manifest.CheckpointCorruptError) as e:
        fmt_reader.read_checkpoint(newer.url, storage_options=opts)
    msg = str(e.value)
    assert newer.url in msg and "Fix: load an older checkpoint" in msg
    if damage in ("truncated", "appended"):
        assert (
            fmt_manifest.MANIFEST in msg and f"expected {newer.packed_size} bytes" in msg and f"got {len(data)}" in msg
        )
    elif damage == "bit flip":  # names the file, both checksums and the fix
        state = next(f for f in newer.files if f.name == "state.pt")
        start = len(data) - sum(f.size for f in newer.files) + state.offset
        got = f"{zlib.crc32(bytes(data[start : start + state.size])):08x}"
        assert "'state.pt' packed in the manifest.json" in msg and f"expected crc32 {state.crc32}, got {got}" in msg
        assert got != state.crc32
    else:
        assert "unreadable" in msg
    loaded = load_latest_valid(url, storage_options=opts)
    assert loaded.info.name == older.name and loaded.files["state.pt"]["batch"] == 1
    assert any(newer.name in r.getMessage() for r in caplog.records)


def test_newer_packed_format_version_is_a_clear_error(storage):
    url, opts = storage
    info = _save(url, opts, 1)
    fs, path, raw = _manifest(opts, info)
    header, rest = raw.split(b"\n", 1)
    m = json.loads(header)
    m["format_version"] = 5
    fs.rm(path)
    sfs.write_bytes_atomic(fs, path, json.dumps(m, separators=(",", ":")).encode() + b"\n" + rest)
    with pytest.raises(fmt_manifest.UnsupportedCheckpointVersionError, match=r"format_version 5.*1\.\.4.*upgrade"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)
    with pytest.raises(fmt_manifest.UnsupportedCheckpointVersionError):  # no silent fallback either
        list_checkpoints(url, storage_options=opts)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_in_a_packed_file_is_refused(storage, tmp_path):
    url, opts = storage
    marker = f"/tmp/pwned-{uuid.uuid4().hex}"
    evil = fmt_writer.serialize({"model": {"w": torch.ones(1)}, "x": _Evil(marker)})
    good = fmt_writer.serialize({"seed": 1})
    files = [
        {"name": "rng-rank0.pt", "size": len(good), "sha256": hashlib.sha256(good).hexdigest(), "offset": 0},
        {"name": "state.pt", "size": len(evil), "sha256": hashlib.sha256(evil).hexdigest(), "offset": len(good)},
    ]
    manifest = {
        "format_version": 2,
        "library_version": "x",
        "created": 0.0,
        "timestamp": {"batch": 1},
        "world_size": 1,
        "metadata": {},
        "files": files,
        "packed": True,
    }  # the attacker wrote a well-formed packed object with correct checksums
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 1})
    fs, path = sfs.resolve(sfs.join(ckpt, fmt_manifest.MANIFEST), opts)
    sfs.write_bytes_create_only(fs, path, packed.packed_object(manifest, [good, evil]))
    try:
        assert fmt_reader.read_checkpoint(ckpt, storage_options=opts, files=["rng-rank0.pt"]).files == {
            "rng-rank0.pt": {"seed": 1}
        }
        with pytest.raises(fmt_manifest.UnsafeCheckpointError) as e:
            fmt_reader.read_checkpoint(ckpt, storage_options=opts)
        assert "state.pt" in str(e.value) and "Nothing in the file was executed" in str(e.value)
        with pytest.raises(fmt_manifest.UnsafeCheckpointError):
            load_latest_valid(url, storage_options=opts)
        assert not os.path.exists(marker)
        control = str(tmp_path / "control")  # positive control: the payload does run code when unpickled
        pickle.loads(pickle.dumps(_Evil(control), protocol=2))
        assert os.path.exists(control)
    finally:
        if os.path.exists(marker):
            os.remove(marker)


def test_already_committed_packed_checkpoint_is_not_overwritten(storage):
    url, opts = storage
    info = _save(url, opts, 3, name="ckpt-000000000003-0000abcd")
    with pytest.raises(fmt_manifest.CheckpointError, match="already committed"):
        _save(url, opts, 3, name="ckpt-000000000003-0000abcd")
    assert fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"]["batch"] == 3


def test_write_checkpoint_packs_small_checkpoints_on_object_stores_only(storage, backend, monkeypatch):
    url, opts = storage
    small = _save(url, opts, 1, pack=None)
    assert small.packed == (backend != "file")  # local saves stream and local loads mmap instead
    monkeypatch.setattr(packed, "PACK_MAX_BYTES", 1000)
    big = _save(url, opts, 2, pack=None)  # > 1000 bytes of tensors: the multi-file layout
    assert not big.packed
    assert [c.name for c in list_checkpoints(url, storage_options=opts)] == [small.name, big.name]


def test_rank_files_plus_commit_still_multi_file(storage):
    """What several ranks do: each uploads its RNG file, rank 0 uploads the state and commits."""
    url, opts = storage
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 9})
    entries = [
        fmt_writer.write_checkpoint_file(ckpt, fmt_writer.rng_file_name(r), {"rank": r}, storage_options=opts)
        for r in (1, 0)
    ]
    entries.append(fmt_writer.write_checkpoint_file(ckpt, "state.pt", _state(9), storage_options=opts))
    info = fmt_writer.commit_checkpoint(
        ckpt, entries=entries, timestamp={"batch": 9}, world_size=2, storage_options=opts
    )
    assert not info.packed and info.format_version == fmt_manifest.MULTI_FILE_VERSION == 4
    loaded = load_latest_valid(url, storage_options=opts)
    assert (
        loaded.info == info
        and loaded.files["rng-rank1.pt"] == {"rank": 1}
        and _same(loaded.files["state.pt"], _state(9))
    )


def test_s3_requests_one_conditional_put_to_save_one_get_to_load(s3_server):
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    opts = s3_server["storage_options"]
    fs, _ = sfs.resolve(url, opts)
    calls: list = []
    real = fs._call_s3

    async def counting(method, *a, **k):
        calls.append((method, {x: k[x] for x in ("IfNoneMatch", "Range") if x in k}))
        return await real(method, *a, **k)

    fs._call_s3 = counting  # resolve() hands out this same cached instance
    try:
        info = _save(url, opts, 1, pack=None)  # 1 MiB-class checkpoints take this path by default
        assert calls == [("put_object", {"IfNoneMatch": "*"})]  # the commit itself: no HEAD, no LIST, no mkdir
        calls.clear()
        assert _same(fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"], _state(1))
        assert calls == [("get_object", {})]  # manifest and payload arrive in the same response
        calls.clear()
        assert load_latest_valid(url, storage_options=opts).info.name == info.name
        ranged = {"Range": f"bytes=0-{packed.HEAD_BYTES - 1}"}
        # no index yet (write_checkpoint alone keeps none): its GET, the LIST, the manifest's head, the object
        assert calls == [("get_object", {}), ("list_objects_v2", {}), ("get_object", ranged), ("get_object", {})]
        CheckpointIndex.load(url, opts).save()  # what a Checkpointer's commits keep up to date
        calls.clear()
        assert load_latest_valid(url, storage_options=opts).info.name == info.name
        assert calls == [("get_object", {}), ("list_objects_v2", {}), ("get_object", {})]
    finally:
        del fs._call_s3


def test_big_packed_files_are_hashed_on_the_hashing_thread_and_still_verified(storage, monkeypatch):
    """Files above 256 KiB (``checksums.BATCH``) take the threaded crc32 path on save and on load."""
    url, opts = storage
    big = {"w": torch.randn(3 * 2**18, generator=torch.Generator().manual_seed(1))}  # 3 MiB
    threaded = []
    real = checksums.hasher

    def counting():
        threaded.append(1)
        return real()

    monkeypatch.setattr(packed, "hasher", counting)
    monkeypatch.setattr(checksums, "hasher", counting)
    info = _save(url, opts, 1, files={"state.pt": big, "rng-rank0.pt": {"seed": 1}})
    with checksums.torch_zip_crc_off():
        expected = f"{zlib.crc32(fmt_writer.serialize(big)):08x}"
    assert threaded and next(f for f in info.files if f.name == "state.pt").crc32 == expected
    threaded.clear()
    assert torch.equal(fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"]["w"], big["w"])
    assert threaded
    fs, path, raw = _manifest(opts, info)
    data = bytearray(raw)
    data[len(data) // 2] ^= 0x10  # inside a tensor's bytes: torch.load alone would not notice
    fs.rm(path)
    sfs.write_bytes_atomic(fs, path, bytes(data))
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match="'state.pt' packed in the manifest.json"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)


def _v2_object(files: dict) -> bytes:
    """A packed checkpoint as the format-version-2 writer made it: sha256 per file, zip CRCs on."""
    payloads = [fmt_writer.serialize(obj) for obj in files.values()]
    entries, offset = [], 0
    for name, data in zip(files, payloads):
        entries.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "offset": offset})
        offset += len(data)
    manifest = {
        "format_version": 2,
        "library_version": "0.1.0",
        "created": 1.0,
        "timestamp": {"epoch": 0, "batch": 5},
        "world_size": 1,
        "metadata": {"written_by": "v2"},
        "files": entries,
        "packed": True,
    }
    return packed.packed_object(manifest, payloads)


def test_version_2_packed_checkpoint_with_sha256_still_loads(storage, caplog):
    url, opts = storage
    older = _save(url, opts, 1)  # a version-3 one below it, for the fallback
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 5})
    fs, path = sfs.resolve(sfs.join(ckpt, fmt_manifest.MANIFEST), opts)
    raw = _v2_object({"rng-rank0.pt": {"seed": 5}, "state.pt": _state(5)})
    sfs.write_bytes_create_only(fs, path, raw)
    info = fmt_reader.read_manifest(ckpt, storage_options=opts)
    assert info.packed and info.format_version == 2 and all(f.crc32 == "" and len(f.sha256) == 64 for f in info.files)
    loaded = fmt_reader.read_checkpoint(ckpt, storage_options=opts)
    assert _same(loaded.files["state.pt"], _state(5)) and loaded.files["rng-rank0.pt"] == {"seed": 5}
    assert info.manifest() == json.loads(raw.split(b"\n", 1)[0])  # re-serializes as version 2, sha256
    listed = list_checkpoints(url, storage_options=opts)
    assert [c.format_version for c in listed] == [3, 2]
    assert load_latest_valid(url, storage_options=opts).info.name == info.name
    # its sha256 still guards it: a flipped payload byte is refused, naming both digests
    data = bytearray(raw)
    data[-100] ^= 0x01
    fs.rm(path)
    sfs.write_bytes_atomic(fs, path, bytes(data))
    state = next(f for f in info.files if f.name == "state.pt")
    start = len(data) - sum(f.size for f in info.files) + state.offset
    got = hashlib.sha256(bytes(data[start : start + state.size])).hexdigest()
    with pytest.raises(
        fmt_manifest.CheckpointCorruptError, match=f"'state.pt' packed .* expected sha256 {state.sha256}, got {got}"
    ):
        fmt_reader.read_checkpoint(ckpt, storage_options=opts)
    assert load_latest_valid(url, storage_options=opts).info.name == older.name


@pytest.mark.parametrize("bad", ["missing", "sha256 instead", "not hex", "int"])
def test_version_3_file_record_without_a_valid_crc32_is_refused(storage, bad):
    url, opts = storage
    info = _save(url, opts, 1)
    fs, path, raw = _manifest(opts, info)
    header, rest = raw.split(b"\n", 1)
    m = json.loads(header)
    record = m["files"][1]
    crc = record.pop("crc32")
    if bad == "sha256 instead":
        record["sha256"] = hashlib.sha256(b"x").hexdigest()
    elif bad == "not hex":
        record["crc32"] = "xyz" + crc[3:]
    elif bad == "int":
        record["crc32"] = int(crc, 16)
    fs.rm(path)
    sfs.write_bytes_atomic(fs, path, packed.header_line(m) + b"\n" + rest)
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match="malformed field"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)


def test_s3_put_carries_the_objects_crc32(s3_server):
    """The one PUT sends ChecksumCRC32 of the whole object (header + payloads, combined from the
    files' CRCs without a second pass): real S3 checks it, and botocore skips its own pass."""
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    opts = s3_server["storage_options"]
    fs, _ = sfs.resolve(url, opts)
    sent: list = []
    real = fs._call_s3

    async def recording(method, *a, **k):
        if method == "put_object":
            sent.append(k.get("ChecksumCRC32"))
        return await real(method, *a, **k)

    fs._call_s3 = recording
    try:
        big = {"w": torch.randn(2**19, generator=torch.Generator().manual_seed(3))}  # threaded path
        info = _save(url, opts, 1, files={"rng-rank0.pt": {"seed": 1}, "state.pt": big})
    finally:
        del fs._call_s3
    raw = _manifest(opts, info)[2]
    assert sent == [base64.b64encode(zlib.crc32(raw).to_bytes(4, "big")).decode()]  # (moto does not check it)


def test_zip_crc_is_off_while_we_save_and_restored_after(storage):
    from torch.utils.serialization import config

    url, opts = storage
    for before in (True, False):
        torch.serialization.set_crc32_options(before)
        try:
            info = _save(url, opts, 1, pack=None)  # packed on memory/S3, multi-file on local disk
            assert config.save.compute_crc32 is before
            with pytest.raises(Exception, match="lambda"):  # a failing save restores it too
                _save(url, opts, 2, files={"state.pt": {"f": lambda: 0}}, pack=None)
            assert config.save.compute_crc32 is before
        finally:
            torch.serialization.set_crc32_options(True)
    if info.packed:
        _, _, raw = _manifest(opts, info)
        start = raw.index(b"\n") + 1
        state = next(f for f in info.files if f.name == "state.pt")
        data = raw[start + state.offset : start + state.offset + state.size]
    else:
        fs, path = sfs.resolve(sfs.join(info.url, "state.pt"), opts)
        data = sfs.read_bytes(fs, path)
    assert not any(i.CRC for i in zipfile.ZipFile(io.BytesIO(data)).infolist())  # saved without zip CRCs
    assert any(i.CRC for i in zipfile.ZipFile(io.BytesIO(fmt_writer.serialize(_state(1)))).infolist())  # control
