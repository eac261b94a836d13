"""checkpoint/folder/store.py: ordering, pruning, crash safety, background saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from raytrain_events.checkpoint.folder.store import (
    AsyncCheckpointWriter,
    latest_checkpoint,
    list_checkpoints,
    load_latest_valid,
    prune_checkpoints,
)
from raytrain_events.checkpoint.format import manifest as fmt_manifest
from raytrain_events.checkpoint.format import writer as fmt_writer
from raytrain_events.storage import fs as sfs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _save(url, opts, batch: int, files=None, pack=None) -> fmt_manifest.CheckpointInfo:
    files = files or {
        "state.pt": {"batch": batch, "w": torch.full((4,), float(batch))},
        "rng-rank0.pt": {"seed": batch},
    }
    return fmt_writer.write_checkpoint(
        url, files=files, timestamp={"batch": batch}, world_size=1, storage_options=opts, pack=pack
    )


def _dirs(url, opts) -> list[str]:
    """The checkpoint directories under ``url`` (not the folder's index.json)."""
    fs, root = sfs.resolve(url, opts)
    return sorted(sfs.basename(e["name"]) for e in sfs.list_dir(fs, root) if e.get("type") == "directory")


def test_empty_or_missing_root(storage):
    url, opts = storage
    assert list_checkpoints(url, storage_options=opts) == []
    assert latest_checkpoint(url, storage_options=opts) is None
    assert load_latest_valid(url, storage_options=opts) is None


def test_sorted_by_batch_then_creation_time(storage):
    url, opts = storage
    for batch in (5, 3, 9, 5):
        _save(url, opts, batch)
    infos = list_checkpoints(url, storage_options=opts)
    assert [c.batch for c in infos] == [3, 5, 5, 9]
    assert infos[1].created <= infos[2].created
    assert latest_checkpoint(url, storage_options=opts).batch == 9


def test_crash_mid_save_leaves_previous_latest_and_loadable(storage, monkeypatch):
    url, opts = storage
    good = _save(url, opts, 100)
    real, calls = fmt_writer._upload, []

    def flaky(fs, path, data):
        calls.append(path)
        if len(calls) == 2:
            raise ConnectionError("injected: network died mid-save")
        real(fs, path, data)

    monkeypatch.setattr(fmt_writer, "_upload", flaky)
    with pytest.raises(ConnectionError, match="injected"):
        _save(url, opts, 200, pack=False)  # the multi-file layout; packed: test_checkpoint_packed.py
    monkeypatch.undo()
    assert len(calls) == 2 and len(_dirs(url, opts)) == 2  # the partial directory exists
    assert latest_checkpoint(url, storage_options=opts).name == good.name
    loaded = load_latest_valid(url, storage_options=opts)
    assert loaded.info.name == good.name and loaded.files["state.pt"]["batch"] == 100


def test_killed_process_mid_save_leaves_previous_latest(storage, backend):
    if backend == "memory":
        pytest.skip("memory:// lives inside one process")
    url, opts = storage
    good = _save(url, opts, 1)
    script = textwrap.dedent(f"""
        import sys, time, json
        import torch
        from raytrain_events.checkpoint.format import manifest as fmt_manifest, writer as fmt_writer
        real = fmt_writer._upload
        def slow(fs, path, data):
            real(fs, path, data)
            print("UPLOADED", flush=True)
            time.sleep(60)
        fmt_writer._upload = slow
        fmt_writer.write_checkpoint({url!r}, files={{"state.pt": torch.ones(3), "b.pt": 2}},
                             timestamp={{"batch": 2}}, world_size=1, pack=False,
                             storage_options=json.loads({json.dumps(opts)!r}))
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}
    )
    try:
        assert proc.stdout.readline().strip() == b"UPLOADED"
    finally:
        proc.kill()
        proc.wait()
    assert len(_dirs(url, opts)) == 2
    assert latest_checkpoint(url, storage_options=opts).name == good.name
    assert load_latest_valid(url, storage_options=opts).info.name == good.name


def test_prune_keeps_exactly_n_newest(storage):
    url, opts = storage
    infos = [_save(url, opts, b) for b in (1, 2, 3, 4, 5)]
    deleted = prune_checkpoints(url, keep=2, storage_options=opts)
    assert len(deleted) == 3
    assert [c.name for c in list_checkpoints(url, storage_options=opts)] == [infos[3].name, infos[4].name]
    assert _dirs(url, opts) == sorted([infos[3].name, infos[4].name])  # really gone
    assert prune_checkpoints(url, keep=2, storage_options=opts) == []
    with pytest.raises(ValueError, match="keep >= 1"):
        prune_checkpoints(url, keep=0, storage_options=opts)


def test_prune_removes_stale_uncommitted_but_not_in_flight(storage):
    url, opts = storage
    crashed = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 3})
    fmt_writer.write_checkpoint_file(crashed, "state.pt", 1, storage_options=opts)
    kept = _save(url, opts, 5)
    in_flight = fmt_writer.new_checkpoint_url(url, timestamp={"batch": 7})
    fmt_writer.write_checkpoint_file(in_flight, "state.pt", 1, storage_options=opts)
    prune_checkpoints(url, keep=1, storage_options=opts)
    assert _dirs(url, opts) == sorted([kept.name, sfs.basename(in_flight)])


def test_async_writer_saves_in_background(storage):
    url, opts = storage
    with AsyncCheckpointWriter() as writer:
        writer.submit(lambda: _save(url, opts, 1))
        info = writer.wait()
    assert latest_checkpoint(url, storage_options=opts).name == info.name


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("raytrain-ckpt-writer")]


def test_async_writer_starts_lazily_and_keeps_one_save_in_flight():
    before = len(_writer_threads())
    writer = AsyncCheckpointWriter()
    assert len(_writer_threads()) == before  # nothing started by construction
    first_running, release_first, log = threading.Event(), threading.Event(), []

    def first():
        first_running.set()
        release_first.wait(5)
        log.append("first done")

    writer.submit(first)
    first_running.wait(5)
    assert writer.busy and len(_writer_threads()) == before + 1
    t = threading.Thread(target=lambda: (writer.submit(lambda: log.append("second")), log.append("second submitted")))
    t.start()
    time.sleep(0.2)
    assert log == []  # the second submit is blocked behind the first save
    release_first.set()
    t.join(5)
    writer.close()
    assert log[0] == "first done" and set(log[1:]) == {"second", "second submitted"}
    assert len(_writer_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(lambda: None)


def test_async_writer_reraises_background_errors():
    writer = AsyncCheckpointWriter()

    def fail():
        raise OSError("bucket vanished")

    writer.submit(fail)
    with pytest.raises(OSError, match="bucket vanished"):
        writer.submit(lambda: None)  # the next submit surfaces the earlier failure
    writer.submit(fail)
    with pytest.raises(OSError, match="bucket vanished"):
        writer.wait()
    writer.submit(fail)
    with pytest.raises(OSError, match="bucket vanished"):
        writer.close()
