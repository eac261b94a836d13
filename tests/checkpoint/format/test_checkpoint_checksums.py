"""checkpoint/format/checksums.py: CRC32 combination, torch's zip CRC switched off (and back), and
files saved that way loading through every reader (local mmap, memory://, S3, packed; S3's
ranged GETs of such files: test_objectstore_transfers.py). Real torch, real files, a real
S3 API (moto on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import zipfile
import zlib

import pytest
import torch
from torch.utils.serialization import config

from raytrain_events.checkpoint.format import checksums
from raytrain_events.checkpoint.format import manifest as fmt_manifest
from raytrain_events.checkpoint.format import reader as fmt_reader
from raytrain_events.checkpoint.format import writer as fmt_writer
from raytrain_events.storage import fs as sfs


@pytest.mark.parametrize("len1,len2", [(0, 0), (0, 7), (7, 0), (1, 1), (300, 3), (5, 2**20 + 9), (2**16, 3 * 2**20)])
def test_crc32_combine_equals_the_crc32_of_the_concatenation(len1, len2):
    a, b = os.urandom(len1), os.urandom(len2)
    assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len2) == zlib.crc32(a + b)


def test_checksum_meanwhile_small_and_threaded():
    small, big = os.urandom(1000), os.urandom(3 * checksums.BATCH)
    for data in (small, big):
        assert checksums.checksum_meanwhile("crc32", data)() == f"{zlib.crc32(data):08x}"
        assert checksums.checksum_meanwhile("sha256", memoryview(data))() == hashlib.sha256(data).hexdigest()


def test_zip_crc_off_nests_and_restores_the_previous_value():
    try:
        for before in (True, False):
            torch.serialization.set_crc32_options(before)
            with checksums.torch_zip_crc_off():
                assert config.save.compute_crc32 is False
                with checksums.torch_zip_crc_off():
                    assert config.save.compute_crc32 is False
                assert config.save.compute_crc32 is False  # the outer user is still inside
            assert config.save.compute_crc32 is before
            with pytest.raises(RuntimeError, match="inside"), checksums.torch_zip_crc_off():
                raise RuntimeError("failure inside")
            assert config.save.compute_crc32 is before
    finally:
        torch.serialization.set_crc32_options(True)


def test_zip_crc_off_in_one_thread_leaves_other_threads_alone():
    """torch 2.13 keeps the override per thread: another thread saving meanwhile keeps its zip CRCs."""
    assert checksums._per_thread()
    inside, leave = threading.Barrier(2), threading.Event()
    seen: list = []

    def user():
        with checksums.torch_zip_crc_off():
            seen.append(config.save.compute_crc32)
            inside.wait()
            leave.wait()
        seen.append(config.save.compute_crc32)

    t = threading.Thread(target=user)
    t.start()
    inside.wait()
    assert config.save.compute_crc32 is True and any(_zip_crcs(fmt_writer.serialize({"w": torch.ones(3)})))
    leave.set()
    t.join()
    assert seen == [False, True]


def test_zip_crc_off_where_torch_keeps_it_process_global(monkeypatch):
    """Other torch versions: a count under a lock; the last user leaving restores the value."""
    monkeypatch.setattr(checksums, "_per_thread", lambda: False)
    first, second = checksums.torch_zip_crc_off(), checksums.torch_zip_crc_off()
    first.__enter__()
    second.__enter__()
    assert config.save.compute_crc32 is False
    first.__exit__(None, None, None)
    assert config.save.compute_crc32 is False  # the second user is still saving
    second.__exit__(None, None, None)
    assert config.save.compute_crc32 is True


def _big_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(2 * fmt_reader._MMAP_MIN_SIZE // 4, generator=g), "step": 3}  # 2 MiB: local mmap path


def _zip_crcs(data: bytes) -> list[int]:
    return [i.CRC for i in zipfile.ZipFile(io.BytesIO(data)).infolist()]


@pytest.mark.parametrize("pack", [False, True])
def test_files_saved_without_zip_crc_load_through_every_reader(storage, backend, pack, monkeypatch):
    url, opts = storage
    state = _big_state()
    info = fmt_writer.write_checkpoint(
        url, files={"state.pt": state}, timestamp={"batch": 1}, world_size=1, storage_options=opts, pack=pack
    )
    fs, path = sfs.resolve(sfs.join(info.url, fmt_manifest.MANIFEST if pack else "state.pt"), opts)
    raw = sfs.read_bytes(fs, path)
    data = raw[raw.index(b"\n") + 1 :] if pack else raw
    assert len(data) == info.files[0].size and not any(_zip_crcs(data))  # torch wrote no zip CRCs
    assert any(_zip_crcs(fmt_writer.serialize(state)))  # control: torch.save on its own does
    mapped: list = []
    real = fmt_reader._torch_load
    monkeypatch.setattr(
        fmt_reader, "_torch_load", lambda *a, **kw: mapped.append(kw.get("mmap", False)) or real(*a, **kw)
    )
    loaded = fmt_reader.read_checkpoint(info.url, storage_options=opts)
    assert torch.equal(loaded.files["state.pt"]["w"], state["w"]) and loaded.files["state.pt"]["step"] == 3
    assert mapped == [not pack and backend == "file"]  # local multi-file: torch.load(path, mmap=True)
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["w"], state["w"])  # plain torch.load too
