"""Loads fetch each saved item they need once, exactly: no read-ahead past it (`ItemStream`).

On s3fs a DCP stream read ahead 50 MiB past each read, so a rank that needed a few small items of
a file fetched most of the file; counted here by the byte ranges of the GETs sent to the S3 server.
"""

from __future__ import annotations

import re

import pytest
import torch

from raytrain_events.checkpoint.dcp.item_stream import ItemStream


class _CountingFS:
    """A local fsspec filesystem that counts ``cat_file`` calls."""

    def __init__(self) -> None:
        import fsspec

        self.fs, self.calls = fsspec.filesystem("file"), []

    def cat_file(self, path, start=None, end=None):
        self.calls.append((start, end))
        return self.fs.cat_file(path, start=start, end=end)


def test_item_stream_fetches_each_item_once_and_refuses_reads_outside_them(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 4)
    fs = _CountingFS()
    stream = ItemStream(fs, str(path), [(10, 20), (500, 100), (10, 20)])
    stream.seek(12)
    assert stream.read(5) == bytes(range(12, 17)) and stream.tell() == 17
    assert stream.read(100) == bytes(range(17, 30))  # never past the item's end
    stream.seek(500)
    buffer = bytearray(60)
    assert stream.readinto(buffer) == 60 and bytes(buffer) == (bytes(range(256)) * 4)[500:560]
    stream.seek(-10, 1)
    assert stream.read() == (bytes(range(256)) * 4)[550:600]
    assert fs.calls == [(10, 30), (500, 600)]  # one fetch per item
    stream.seek(40)
    with pytest.raises(ValueError, match="outside the items this load planned"):
        stream.read(1)


def test_a_load_from_s3_fetches_only_the_items_it_needs(s3_server, monkeypatch):
    import s3fs
    import torch.distributed.checkpoint as dcp

    from raytrain_events._torch_compat import FsspecWriter
    from raytrain_events.checkpoint.dcp.safe_dcp import SafeDCPReader

    url = f"s3://{s3_server['bucket']}/item-stream"
    options = s3_server["storage_options"]
    state = {f"big{i}": torch.randn(64, 1024) for i in range(4)}  # 256 KiB each
    state.update({f"small{i}": torch.randn(8) for i in range(4)})
    dcp.save(state, storage_writer=FsspecWriter(url, **options), no_dist=True)

    ranges = []
    call = s3fs.S3FileSystem._call_s3

    async def counting_call(self, method, *args, **kwargs):
        if method == "get_object" and not kwargs.get("Key", "").endswith(".metadata"):
            ranges.append(kwargs.get("Range"))
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting_call)
    wanted = {f"small{i}": torch.zeros(8) for i in range(4)} | {"big2": torch.zeros(64, 1024)}
    dcp.load(wanted, storage_reader=SafeDCPReader(url, **options), no_dist=True)
    for key, value in wanted.items():
        assert torch.equal(value, state[key]), key

    fetched = 0
    for spec in ranges:
        start, end = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", spec).groups())
        fetched += end - start + 1
    needed = 4 * 8 * 4 + 64 * 1024 * 4
    # Each item is its torch.save zip (~1.5 KiB of headers around the tensor's bytes); read-ahead
    # fetched the whole 1 MiB file. One GET per item.
    assert len(ranges) == 5 and fetched < needed + 5 * 2048, (len(ranges), fetched, needed)
