"""exp_dir.py: picking and claiming run_N directories, saving/loading the run config."""

from __future__ import annotations

import threading

import pytest
from omegaconf import OmegaConf

from raytrain_events.storage import fs as sfs
from raytrain_events.storage.exp_dir import RunDir, get_empty_exp_dir
from raytrain_events.storage.locks import acquire_lock, has_lock


def test_gives_run_1_then_run_2_and_claims_them(storage):
    url, opts = storage
    first = get_empty_exp_dir(url, storage_options=opts)
    assert first == sfs.join(url, "run_1")
    assert has_lock(first, "scheduled", storage_options=opts)
    assert get_empty_exp_dir(url, storage_options=opts) == sfs.join(url, "run_2")


def test_next_is_one_past_the_largest_and_ignores_other_dirs(storage):
    url, opts = storage
    fs, root = sfs.resolve(url, opts)
    sfs.write_bytes_atomic(fs, sfs.join(root, "run_7", "config.yaml"), b"a: 1")  # finished run
    sfs.write_bytes_atomic(fs, sfs.join(root, "run_x", "f"), b"")
    sfs.write_bytes_atomic(fs, sfs.join(root, "notes", "f"), b"")
    assert get_empty_exp_dir(url, storage_options=opts) == sfs.join(url, "run_8")


def test_skips_a_run_dir_that_holds_a_lock(storage, monkeypatch):
    url, opts = storage
    # Another launcher locked run_1 after our listing saw an empty root.
    acquire_lock(sfs.join(url, "run_1"), "running", storage_options=opts)
    monkeypatch.setattr("raytrain_events.storage.exp_dir.list_dir", lambda fs, path: [])
    assert get_empty_exp_dir(url, storage_options=opts) == sfs.join(url, "run_2")


def test_concurrent_launchers_get_distinct_dirs(storage):
    url, opts = storage
    n = 6
    barrier = threading.Barrier(n)
    got: list[str] = []

    def launch() -> None:
        barrier.wait()
        got.append(get_empty_exp_dir(url, storage_options=opts))

    threads = [threading.Thread(target=launch) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == n and len(set(got)) == n


def test_unclaimed_mode_writes_nothing(storage):
    url, opts = storage
    assert get_empty_exp_dir(url, storage_options=opts, claim_with=None) == sfs.join(url, "run_1")
    assert get_empty_exp_dir(url, storage_options=opts, claim_with=None) == sfs.join(url, "run_1")


def test_run_dir_config_round_trip(storage):
    url, opts = storage
    run = RunDir(sfs.join(url, "run_1"), opts)
    cfg = OmegaConf.create({"model": {"hidden": 64, "layers": [1, 2]}, "lr": 0.1, "name": "${model.hidden}"})
    run.save_config(cfg)
    loaded = run.load_config()
    assert loaded == cfg
    assert OmegaConf.to_container(loaded)["name"] == "${model.hidden}"  # saved unresolved
    run.save_config({"lr": 0.2})
    assert run.load_config().lr == 0.2


def test_load_config_missing_names_fix(storage):
    url, opts = storage
    with pytest.raises(FileNotFoundError, match="save_config"):
        RunDir(sfs.join(url, "run_9"), opts).load_config()
