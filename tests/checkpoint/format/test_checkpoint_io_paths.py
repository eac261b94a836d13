"""checkpoint/format.py I/O paths: streamed local save, mmap local load, listing-free commit,
S3 request counts. (test_checkpoint_format.py covers the format itself on small files, which
take the in-memory paths; the files here are >= 1 MiB so local loads go through mmap.)"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import shutil
import uuid
import zlib

import pytest
import torch

from raytrain_events.checkpoint.folder.index import CheckpointIndex
from raytrain_events.checkpoint.folder.store import latest_checkpoint, load_latest_valid
from raytrain_events.checkpoint.format import manifest as fmt_manifest
from raytrain_events.checkpoint.format import reader as fmt_reader
from raytrain_events.checkpoint.format import writer as fmt_writer
from raytrain_events.checkpoint.format.checksums import torch_zip_crc_off
from raytrain_events.storage import fs as sfs
from raytrain_events.storage.errors import StorageError

BIG = 2 * fmt_reader._MMAP_MIN_SIZE // 4  # float32 elements: a 2 MiB tensor


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(BIG, generator=g), "b": torch.arange(10), "step": 3, "name": "x"}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]


def _leftovers(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def test_streamed_local_save_writes_the_same_bytes_as_torch_save(tmp_path):
    obj = _state()
    ckpt = str(tmp_path / "ckpt")
    entry = fmt_writer.write_checkpoint_file(ckpt, "state.pt", obj)
    with open(os.path.join(ckpt, "state.pt"), "rb") as f:
        data = f.read()
    with torch_zip_crc_off():  # how checkpoints call torch.save (our CRC32 covers the bytes)
        assert data == fmt_writer.serialize(obj)  # on-disk format unchanged by streaming
    assert entry.size == len(data) and entry.crc32 == f"{zlib.crc32(data):08x}" and entry.sha256 == ""
    assert _leftovers(ckpt) == []


def test_failed_local_save_leaves_nothing_under_the_final_name(tmp_path):
    good = fmt_writer.write_checkpoint(
        str(tmp_path), files={"state.pt": _state()}, timestamp={"batch": 1}, world_size=1
    )
    ckpt = fmt_writer.new_checkpoint_url(str(tmp_path), timestamp={"batch": 2})
    bad = {"w": torch.ones(BIG), "f": lambda: 0}  # pickling fails after a big tensor record
    with pytest.raises(Exception) as e:
        fmt_writer.write_checkpoint_file(ckpt, "state.pt", bad)
    assert not isinstance(e.value, StorageError)  # a serialization error, raised as such
    assert os.listdir(ckpt) == []  # no state.pt, no temp file
    assert latest_checkpoint(str(tmp_path)).name == good.name


def test_disk_full_during_streamed_save_is_a_storage_error(tmp_path, monkeypatch):
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.n += memoryview(data).nbytes
            if self.n > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(
        os,
        "fdopen",
        lambda fd, mode="r", *a, **k: (
            FullDisk(real_fdopen(fd, mode, *a, **k)) if mode == "wb" else real_fdopen(fd, mode, *a, **k)
        ),
    )
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(StorageError, match="No space left") as e:
        fmt_writer.write_checkpoint_file(ckpt, "state.pt", _state())
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(ckpt) == []


def test_local_atomic_writer_keeps_old_content_on_error(tmp_path):
    path = str(tmp_path / "f.bin")
    sfs.write_bytes_atomic(sfs.resolve(path)[0], path, b"old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with sfs.local_atomic_writer(path, crc32=True) as f:
            f.write(b"new" * 1000)
            raise RuntimeError("mid-write")
    assert open(path, "rb").read() == b"old" and _leftovers(str(tmp_path)) == []
    with sfs.local_atomic_writer(path, crc32=True) as f:
        f.write(b"ab")
        f.write(memoryview(b"cd"))
    assert open(path, "rb").read() == b"abcd"
    assert (f.size, f.hexdigest()) == (4, f"{zlib.crc32(b'abcd'):08x}")


def test_large_local_load_verifies_and_survives_deletion(tmp_path, monkeypatch):
    obj = _state()
    info = fmt_writer.write_checkpoint(str(tmp_path), files={"state.pt": obj}, timestamp={"batch": 1}, world_size=1)
    assert info.files[0].size >= fmt_reader._MMAP_MIN_SIZE

    def no_read(fs, path, **kw):
        assert path.endswith(fmt_manifest.MANIFEST), "read the payload into memory instead of mapping it"
        return sfs.read_bytes(fs, path, **kw)

    monkeypatch.setattr(fmt_reader, "read_bytes", no_read)
    loaded = fmt_reader.read_checkpoint(info.url).files["state.pt"]
    _assert_same(loaded, obj)
    loaded["w"].add_(1)  # copy-on-write: the file keeps the saved values
    _assert_same(fmt_reader.read_checkpoint(info.url).files["state.pt"], obj)
    again = fmt_reader.read_checkpoint(info.url).files["state.pt"]
    shutil.rmtree(info.url)  # what pruning does; the mapping stays valid (POSIX)
    _assert_same(again, obj)


def test_large_local_corruption_is_detected(tmp_path):
    info = fmt_writer.write_checkpoint(
        str(tmp_path), files={"state.pt": _state()}, timestamp={"batch": 1}, world_size=1
    )
    fs, path = sfs.resolve(os.path.join(info.url, "state.pt"))
    good = sfs.read_bytes(fs, path)
    for pos in (len(good) // 2, 0):  # tensor data; the zip header (torch.load would choke)
        data = bytearray(good)
        data[pos] ^= 0x01
        sfs.write_bytes_atomic(fs, path, bytes(data))
        with pytest.raises(fmt_manifest.CheckpointCorruptError) as e:
            fmt_reader.read_checkpoint(info.url)
        assert f"crc32 {zlib.crc32(bytes(data)):08x}" in str(e.value)
    assert load_latest_valid(str(tmp_path)) is None


def test_large_local_truncation_is_caught_by_size_before_hashing(tmp_path, monkeypatch):
    info = fmt_writer.write_checkpoint(
        str(tmp_path), files={"state.pt": _state()}, timestamp={"batch": 1}, world_size=1
    )
    fs, path = sfs.resolve(os.path.join(info.url, "state.pt"))
    sfs.write_bytes_atomic(fs, path, sfs.read_bytes(fs, path)[:-7])

    def no_mapping(*a, **k):
        raise AssertionError("mapped/hashed a file of the wrong size")

    monkeypatch.setattr(fmt_reader.mmap, "mmap", no_mapping)
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match=f"got {info.files[0].size - 7} bytes"):
        fmt_reader.read_checkpoint(info.url)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_large_malicious_file_is_refused_on_the_mmap_path(tmp_path, kind):
    marker = f"/tmp/pwned-{uuid.uuid4().hex}"
    payload = {"w": torch.ones(BIG), "pad": b"x" * (2 << 20), "x": _Evil(marker)}
    data = fmt_writer.serialize(payload) if kind == "torch.save" else pickle.dumps(payload, protocol=2)
    assert len(data) >= fmt_reader._MMAP_MIN_SIZE
    ckpt = fmt_writer.new_checkpoint_url(str(tmp_path), timestamp={"batch": 1})
    fs, path = sfs.resolve(os.path.join(ckpt, "state.pt"))
    sfs.write_bytes_atomic(fs, path, data)
    entry = fmt_manifest.FileEntry("state.pt", len(data), hashlib.sha256(data).hexdigest())
    fmt_writer.commit_checkpoint(ckpt, entries=[entry], timestamp={"batch": 1}, world_size=1)
    try:
        with pytest.raises(fmt_manifest.UnsafeCheckpointError, match="Nothing in the file was executed"):
            fmt_reader.read_checkpoint(ckpt)
        assert not os.path.exists(marker)
    finally:
        if os.path.exists(marker):
            os.remove(marker)


def test_commit_lists_the_directory_unless_told_not_to(storage, monkeypatch):
    url, opts = storage

    def no_listing(*a, **k):
        raise AssertionError("listed the checkpoint directory")

    monkeypatch.setattr(fmt_writer, "list_dir", no_listing)
    info = fmt_writer.write_checkpoint(
        url, files={"state.pt": {"a": 1}}, timestamp={"batch": 1}, world_size=1, storage_options=opts
    )  # uploaded it: no listing
    assert fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"] == {"a": 1}
    ckpt = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 2})
    entry = fmt_writer.write_checkpoint_file(ckpt, "rng-rank1.pt", 1, storage_options=opts)
    with pytest.raises(AssertionError, match="listed"):  # entries from elsewhere: checked
        fmt_writer.commit_checkpoint(ckpt, entries=[entry], timestamp={"batch": 2}, world_size=2, storage_options=opts)
    fmt_writer.commit_checkpoint(
        ckpt, entries=[entry], timestamp={"batch": 2}, world_size=2, storage_options=opts, verify_files=False
    )


@pytest.mark.parametrize("pack", [False, True])
def test_s3_request_counts(s3_server, pack):
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    opts = s3_server["storage_options"]
    fs, _ = sfs.resolve(url, opts)
    calls: list[str] = []
    real = fs._call_s3

    async def counting(method, *a, **k):
        calls.append(method)
        return await real(method, *a, **k)

    fs._call_s3 = counting  # resolve() hands out this same cached instance
    try:
        info = fmt_writer.write_checkpoint(
            url, files={"state.pt": _state()}, timestamp={"batch": 1}, world_size=1, storage_options=opts, pack=pack
        )
        # multi-file: payload, manifest, no LIST; packed: the one create-only PUT is the commit
        assert calls == ["put_object"] * (1 if pack else 2)
        calls.clear()
        _assert_same(fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"], _state())
        assert calls == ["get_object"] * (1 if pack else 2)  # (manifest, payload): no HEADs
        calls.clear()
        assert load_latest_valid(url, storage_options=opts).info.name == info.name
        # the folder's index (missing: write_checkpoint alone does not keep one), the LIST that
        # reconciles it, the manifest of the unindexed checkpoint (read once), its payload
        assert calls == ["get_object", "list_objects_v2", "get_object", "get_object"]
        CheckpointIndex.load(url, opts).save()  # what a Checkpointer's commits keep up to date
        calls.clear()
        assert load_latest_valid(url, storage_options=opts).info.name == info.name
        # index, LIST, then the checkpoint as read_checkpoint reads it (manifest, payload if not packed)
        assert calls == ["get_object", "list_objects_v2"] + ["get_object"] * (1 if pack else 2)
    finally:
        del fs._call_s3
