"""storage/objectstore/ through the checkpoint format, on the moto S3 server: multipart
uploads fed while torch.save runs, ranged downloads hashed as they arrive, and what happens
when either is interrupted or the stored bytes are wrong.

Parts are 5 MiB here (``default_block_size``, S3's minimum) so a ~13 MiB state takes the
multipart and ranged paths: 3 parts, 3 ranges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
import zlib

import pytest
import torch

from raytrain_events.checkpoint.folder.store import latest_checkpoint, load_latest_valid, prune_checkpoints
from raytrain_events.checkpoint.format import manifest as fmt_manifest
from raytrain_events.checkpoint.format import reader as fmt_reader
from raytrain_events.checkpoint.format import writer as fmt_writer
from raytrain_events.checkpoint.format.checksums import torch_zip_crc_off
from raytrain_events.storage import fs as sfs
from raytrain_events.storage import objectstore
from raytrain_events.storage.crc32 import s3_checksum
from raytrain_events.storage.errors import StorageError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PART = 5 * 2**20


@pytest.fixture
def s3(s3_server):
    """(root URL, storage options with 5 MiB parts and 3 in flight, the s3fs instance)."""
    opts = {**s3_server["storage_options"], "default_block_size": PART, "max_concurrency": 3}
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    fs, _ = sfs.resolve(url, opts)
    return url, opts, fs


def _state(seed: int = 0, mib: float = 13) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(int(mib * 2**20 / 4), generator=g), "step": seed}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _save(url, opts, batch, obj=None):
    return fmt_writer.write_checkpoint(
        url,
        files={"state.pt": obj or _state(batch)},
        timestamp={"batch": batch},
        world_size=1,
        storage_options=opts,
        pack=False,  # these test the multi-file layout's transfers; packed: test_checkpoint_packed.py
    )


class _Calls(list):
    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[tuple[str, int], BaseException] = {}
        self.kwargs: list[tuple[str, dict]] = []  # (method, its keyword arguments) of each call


@pytest.fixture
def calls(s3, monkeypatch):
    """Records every S3 API call; ``calls.fail[(method, n)] = exc`` makes the n-th such call raise."""
    _, _, fs = s3
    real = fs._call_s3
    log = _Calls()

    async def counting(method, *a, **k):
        log.append(method)
        log.kwargs.append((method, k))
        exc = log.fail.pop((method, log.count(method)), None)
        if exc is not None:
            raise exc
        return await real(method, *a, **k)

    monkeypatch.setattr(fs, "_call_s3", counting)
    return log


def _open_uploads(fs, bucket: str, url: str) -> list:
    """The unfinished multipart uploads under this test's own prefix (``url``): the session's bucket is shared,
    and another file's test may leave one of its own behind on purpose (a killed upload)."""
    prefix = url.split("://", 1)[1].split("/", 1)[1] + "/"
    return fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])


def test_large_file_goes_up_in_parts_and_comes_back_in_ranges(s3, calls):
    url, opts, fs = s3
    obj = _state(1)
    info = _save(url, opts, 1, obj)
    assert calls == ["create_multipart_upload"] + ["upload_part"] * 3 + ["complete_multipart_upload", "put_object"]
    stored = sfs.read_bytes(fs, sfs.resolve(sfs.join(info.url, "state.pt"), opts)[1])
    with torch_zip_crc_off():  # how checkpoints call torch.save (our CRC32 covers the bytes)
        assert stored == fmt_writer.serialize(obj)  # the bytes are what torch.save writes; the manifest hashes them
    assert info.files[0].size == len(stored)
    calls.clear()
    assert _same(fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"], obj)
    assert calls == ["get_object"] * 4  # manifest + 3 ranges, no HEAD
    # a reader with other part settings reads the same checkpoint (one plain GET)
    plain = {k: v for k, v in opts.items() if k not in ("default_block_size", "max_concurrency")}
    assert _same(fmt_reader.read_checkpoint(info.url, storage_options=plain).files["state.pt"], obj)


def test_each_request_carries_the_crc32_of_its_body_and_the_manifest_the_files(s3, calls):
    """The CRC32s go with the requests (the store verifies them; botocore computes none of its
    own) and the file's recorded CRC32 is combined from its parts' without another pass."""
    url, opts, fs = s3
    big = _save(url, opts, 1)
    parts = [k for m, k in calls.kwargs if m == "upload_part"]
    assert sorted(k["PartNumber"] for k in parts) == [1, 2, 3]  # sent concurrently: any order
    for k in parts:
        assert k["ChecksumCRC32"] == s3_checksum(zlib.crc32(k["Body"]))
    stored = sfs.read_bytes(fs, sfs.resolve(sfs.join(big.url, "state.pt"), opts)[1])
    assert len(stored) > 2 * PART and big.files[0].crc32 == f"{zlib.crc32(stored):08x}"
    calls.kwargs.clear()
    small = _save(url, opts, 2, {"w": torch.ones(1000)})
    put = [k for m, k in calls.kwargs if m == "put_object" and k["Key"].endswith("/state.pt")]
    stored = sfs.read_bytes(fs, sfs.resolve(sfs.join(small.url, "state.pt"), opts)[1])
    assert [k["ChecksumCRC32"] for k in put] == [s3_checksum(zlib.crc32(stored))]
    assert small.files[0].crc32 == f"{zlib.crc32(stored):08x}"


def test_small_file_is_one_put_and_one_get(s3, calls):
    url, opts, _ = s3
    info = _save(url, opts, 1, {"w": torch.ones(1000)})
    assert calls == ["put_object", "put_object"]
    calls.clear()
    assert torch.equal(
        fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"]["w"], torch.ones(1000)
    )
    assert calls == ["get_object", "get_object"]


def test_multipart_upload_interrupted_midway_commits_nothing(s3, calls, s3_server):
    url, opts, fs = s3
    good = _save(url, opts, 1)
    calls.clear()
    calls.fail[("upload_part", 2)] = ConnectionError("injected: network died at part 2")
    with pytest.raises(StorageError, match="injected") as e:
        _save(url, opts, 2)
    assert url.split("://")[1] in str(e.value)  # names the object
    assert "abort_multipart_upload" in calls and "complete_multipart_upload" not in calls
    assert "put_object" not in calls  # no manifest
    assert _open_uploads(fs, s3_server["bucket"], url) == []  # aborted: no parts left behind
    assert latest_checkpoint(url, storage_options=opts).name == good.name
    loaded = load_latest_valid(url, storage_options=opts)
    assert loaded.info.name == good.name and _same(loaded.files["state.pt"], _state(1))


def test_failed_complete_commits_nothing(s3, calls, s3_server):
    url, opts, fs = s3
    good = _save(url, opts, 1)
    calls.clear()
    calls.fail[("complete_multipart_upload", 1)] = ConnectionError("injected: complete failed")
    with pytest.raises(StorageError, match="complete failed"):
        _save(url, opts, 2)
    assert _open_uploads(fs, s3_server["bucket"], url) == []
    assert load_latest_valid(url, storage_options=opts).info.name == good.name


def test_error_inside_torch_save_mid_multipart_aborts_the_upload(s3, calls, s3_server, monkeypatch):
    url, opts, fs = s3
    real = objectstore.upload._S3Upload.write

    def failing(self, data):  # e.g. a MemoryError or an interrupt while torch.save is writing
        if self.size > 2 * PART + 2**20:
            raise RuntimeError("injected: serialization failed after 2 parts")
        return real(self, data)

    monkeypatch.setattr(objectstore.upload._S3Upload, "write", failing)
    with pytest.raises(RuntimeError) as e:  # torch replaces it with its own zip-writer error
        _save(url, opts, 1)
    assert not isinstance(e.value, StorageError)
    assert "create_multipart_upload" in calls and "abort_multipart_upload" in calls  # parts: sent or cancelled
    assert "complete_multipart_upload" not in calls and "put_object" not in calls
    assert _open_uploads(fs, s3_server["bucket"], url) == []
    assert latest_checkpoint(url, storage_options=opts) is None


def test_killed_process_mid_multipart_leaves_previous_latest(s3, s3_server):
    url, opts, fs = s3
    good = _save(url, opts, 1)
    script = textwrap.dedent(f"""
        import json, time
        import torch
        from raytrain_events.checkpoint.format import manifest as fmt_manifest, reader as fmt_reader, writer as fmt_writer
        from raytrain_events.storage import fs as sfs
        opts = json.loads({json.dumps(opts)!r})
        fs, _ = sfs.resolve({url!r}, opts)
        real = fs._call_s3
        async def slow(method, *a, **k):
            out = await real(method, *a, **k)
            if method == "upload_part":
                print("PART", flush=True)
                time.sleep(60)  # blocks fsspec's loop: no further part, no complete
            return out
        fs._call_s3 = slow
        fmt_writer.write_checkpoint({url!r}, files={{"state.pt": {{"w": torch.randn(13 * 2**18)}}}},
                             timestamp={{"batch": 2}}, world_size=1, storage_options=opts, pack=False)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}
    )
    try:
        assert proc.stdout.readline().strip() == b"PART"
    finally:
        proc.kill()
        proc.wait()
    uploads = _open_uploads(fs, s3_server["bucket"], url)
    assert [u["Key"].rsplit("/", 1)[1] for u in uploads] == ["state.pt"]  # incomplete: invisible
    assert latest_checkpoint(url, storage_options=opts).name == good.name
    assert _same(load_latest_valid(url, storage_options=opts).files["state.pt"], _state(1))
    assert prune_checkpoints(url, keep=1, storage_options=opts) == []
    for u in uploads:  # tidy the server for the other tests
        fs.call_s3("abort_multipart_upload", Bucket=s3_server["bucket"], Key=u["Key"], UploadId=u["UploadId"])


def _rewrite(fs, opts, info, change) -> bytes:
    path = sfs.resolve(sfs.join(info.url, "state.pt"), opts)[1]
    data = change(bytearray(sfs.read_bytes(fs, path)))
    fs.pipe_file(path, bytes(data))
    return bytes(data)


def test_corrupted_part_is_detected_on_load(s3, caplog):
    url, opts, fs = s3
    older = _save(url, opts, 1)
    newer = _save(url, opts, 2)

    def flip(data):
        data[PART + PART // 2] ^= 0x01  # inside the second part / range
        return data

    bad = _rewrite(fs, opts, newer, flip)
    with pytest.raises(fmt_manifest.CheckpointCorruptError) as e:
        fmt_reader.read_checkpoint(newer.url, storage_options=opts)
    msg = str(e.value)
    assert "state.pt" in msg and f"crc32 {newer.files[0].crc32}" in msg and f"crc32 {zlib.crc32(bad):08x}" in msg
    assert "load_latest_valid" in msg  # says what to do
    loaded = load_latest_valid(url, storage_options=opts)
    assert loaded.info.name == older.name and _same(loaded.files["state.pt"], _state(1))


@pytest.mark.parametrize("delta", [10, -10])
def test_wrong_size_is_refused_before_the_other_ranges_are_read(s3, calls, delta):
    url, opts, fs = s3
    info = _save(url, opts, 1)
    _rewrite(fs, opts, info, lambda d: d + b"x" * delta if delta > 0 else d[:delta])
    calls.clear()
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match=f"got {info.files[0].size + delta} bytes"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)
    assert calls == ["get_object", "get_object"]  # manifest, first range: it told the size


def test_download_resumes_after_a_dropped_connection(s3, monkeypatch):
    url, opts, fs = s3
    obj = _state(3)
    info = _save(url, opts, 3, obj)
    real, dropped = fs._call_s3, []

    class Flaky:
        def __init__(self, body):
            self.body, self.n = body, 0

        async def readinto(self, b):
            self.n += 1
            if self.n == 3 and not dropped:
                dropped.append(1)
                raise ConnectionResetError("injected: connection reset mid-body")
            return await self.body.readinto(b)

        def close(self):
            self.body.close()

    async def flaky(method, *a, **k):
        out = await real(method, *a, **k)
        if method == "get_object" and k.get("Range", "").startswith(f"bytes={PART}-"):
            out["Body"] = Flaky(out["Body"])
        return out

    monkeypatch.setattr(fs, "_call_s3", flaky)
    assert _same(fmt_reader.read_checkpoint(info.url, storage_options=opts).files["state.pt"], obj)
    assert dropped


def test_missing_payload_is_reported_as_missing(s3):
    url, opts, fs = s3
    info = _save(url, opts, 1)
    fs.rm(sfs.resolve(sfs.join(info.url, "state.pt"), opts)[1])
    with pytest.raises(fmt_manifest.CheckpointCorruptError, match="is missing"):
        fmt_reader.read_checkpoint(info.url, storage_options=opts)


def test_reader_serves_torch_load_from_a_bytearray():
    data = bytearray(fmt_writer.serialize({"w": torch.arange(10)}))
    f = objectstore.reader(data)
    assert torch.equal(torch.load(f, weights_only=True)["w"], torch.arange(10))
    f.seek(-3, 2)
    assert f.read() == bytes(data[-3:]) and f.tell() == len(data)
