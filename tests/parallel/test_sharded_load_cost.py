"""What a sharded load reads: ``.metadata`` and the manifest once per load (rank 0, shared), and on
an N -> M reshard only the overlapping bytes of each saved tensor (issue 28 item 1).

Bytes are counted at the fsspec layer in each spawned gloo rank (`tests/parallel/io_count.py`).
"""

from __future__ import annotations

import io
import os
import shutil
import uuid

import pytest
import torch

from raytrain_events.checkpoint import list_checkpoints
from raytrain_events.checkpoint.dcp import ranged_dcp
from tests.parallel.reshard_workloads import (
    full_tier_load,
    full_tier_save,
    tier_load,
    tier_save,
    wide_load,
    wide_load_error,
    wide_save,
)
from tests.parallel.spawn import run_ranks

WIDTH = 512  # 1 MiB per Block weight: the small items (biases, Adam steps), read whole, are a few percent


def _dcp_bytes(info):
    return sum(f.size for f in info.files if f.name.endswith(".distcp") or f.name == ".metadata")


def _check_reshard(folder, saved_at, load_at, storage_options=None, width=WIDTH):
    saved = run_ranks(saved_at, wide_save, folder, width, storage_options)[0]
    info = list_checkpoints(folder, storage_options=storage_options)[-1]
    assert info.world_size == saved_at and info.metadata["layout"] == "dcp"
    loaded = run_ranks(load_at, wide_load, folder, width, storage_options)
    for rank, got in enumerate(loaded):
        assert got["loaded"] == info.name
        for part in ("model", "optim", "ema"):
            assert got[part].keys() == saved[part].keys()
            for key in saved[part]:
                torch.testing.assert_close(got[part][key], saved[part][key], rtol=0, atol=0, msg=f"rank {rank} {key}")
    counts = [got["counts"] for got in loaded]
    assert sum(c["metadata_opens"] for c in counts) == 1, counts  # rank 0 alone, once
    return info, counts


@pytest.mark.parametrize("saved_at,load_at", [(4, 3), (2, 4)])
def test_reshard_reads_each_byte_about_once(tmp_path, saved_at, load_at):
    info, counts = _check_reshard(str(tmp_path / "checkpoints"), saved_at, load_at)
    read = sum(n for c in counts for name, n in c["bytes"].items() if name.endswith(".distcp") or name == ".metadata")
    ratio = read / _dcp_bytes(info)
    assert ratio <= 1.1, f"{saved_at} -> {load_at} read {ratio:.2f}x the checkpoint's DCP bytes: {counts}"
    assert sum(1 for c in counts if c["bytes"].get(".metadata")) == 1
    assert sum(1 for c in counts if c["bytes"].get("manifest.json")) == 1  # rank 0 shares the manifest


def test_metadata_read_once_on_s3(s3_server):
    options = s3_server["storage_options"]
    folder = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}/checkpoints"
    _check_reshard(folder, 2, 3, options, width=64)


def test_metadata_errors_on_rank_0_are_raised_on_every_rank(tmp_path):
    """Rank 0 alone reads ``.metadata``: a refused or corrupt one fails every rank (none waits)."""
    folder = str(tmp_path / "checkpoints")
    run_ranks(2, wide_save, folder, 16)
    info = list_checkpoints(folder)[-1]
    with open(f"{info.url}/.metadata", "ab") as f:  # bytes after the pickle's end: unpickles, fails the size
        f.write(b"\0" * 8)
    got = run_ranks(2, wide_load_error, folder, 16)
    assert all(e.startswith("CheckpointCorruptError") and "does not match the checkpoint's manifest" in e for e in got)
    with open(f"{info.url}/.metadata", "wb") as f:  # a pickle that would run os.system
        f.write(b"cos\nsystem\n(S'echo pwned'\ntR.")
    got = run_ranks(2, wide_load_error, folder, 16)
    assert all(e.startswith("UnsafeCheckpointError") for e in got), got


# ---------------------------------------------------------------- the ranged reader, one process
def _item(tensor):
    raw = io.BytesIO()
    torch.save(tensor, raw)
    data = raw.getvalue()
    return data, data[: ranged_dcp.PROBE], data[-ranged_dcp.PROBE :]


def test_layout_finds_the_tensor_bytes_in_a_torch_save_item():
    tensor = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    data, head, tail = _item(tensor)
    layout = ranged_dcp.parse_layout(len(data), head, tail)
    assert layout is not None and layout.size == (64, 48) and layout.dtype == torch.float32
    first, count = ranged_dcp.contiguous_run(layout.size, (10, 0), (7, 48))
    start = layout.data_start + first * 4
    got = torch.frombuffer(bytearray(data[start : start + count * 4]), dtype=torch.float32).reshape(7, 48)
    assert torch.equal(got, tensor[10:17])


def test_layout_refuses_what_a_ranged_read_would_get_wrong():
    transposed = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48).t()  # saved with its strides
    data, head, tail = _item(transposed)
    assert ranged_dcp.parse_layout(len(data), head, tail) is None
    data, head, tail = _item({"a": torch.zeros(600)})  # not a lone tensor
    assert ranged_dcp.parse_layout(len(data), head, tail) is None
    data = b"PK" + bytes(5000)  # not a zip
    assert ranged_dcp.parse_layout(len(data), data[:1024], data[-1024:]) is None


def test_contiguous_run_only_for_one_run():
    assert ranged_dcp.contiguous_run((8, 4, 3), (2, 0, 0), (3, 4, 3)) == (24, 36)
    assert ranged_dcp.contiguous_run((8, 4, 3), (2, 1, 0), (1, 2, 3)) == (27, 6)
    assert ranged_dcp.contiguous_run((8, 4, 3), (2, 1, 0), (2, 2, 3)) is None  # rows 1-2 of two planes
    assert ranged_dcp.contiguous_run((8, 4), (0, 1), (8, 2)) is None  # a column block (dim-1 shard)


def test_sharded_restart_reads_shards_from_the_local_tier_and_a_moved_rank_reads_storage(s3_server, tmp_path):
    """2 FSDP ranks, each on its own node-local directory, save to S3. A restart of both on one node that
    holds both copies reads no shard (nor ``.metadata``) from S3. A restart with rank 1 on a new node (an
    empty directory) reads exactly rank 1's own shard from S3, and rank 0 none of its own files (DCP writes a
    replicated item once, in one rank's file, so a rank on another node than that rank reads such items
    from storage). Both load the saved state exactly each time."""
    options = s3_server["storage_options"]
    folder = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}/run/checkpoints"
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ranks(2, tier_save, folder, 256, options, nodes)[0]
    info = list_checkpoints(folder, storage_options=options)[-1]
    shards = {f.name: f.size for f in info.files if f.name.endswith(".distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]
    both = tmp_path / "both"  # one node that held both ranks
    for node in nodes:
        shutil.copytree(node, both, dirs_exist_ok=True)

    def restart(placement):
        loaded = run_ranks(2, tier_load, folder, 256, options, placement)
        for got in loaded:
            for part in ("model", "optim", "ema"):
                for key in saved[part]:
                    torch.testing.assert_close(got[part][key], saved[part][key], rtol=0, atol=0, msg=key)
        return [{k: n for k, n in got["s3"].items() if k.endswith((".distcp", ".metadata"))} for got in loaded]

    assert restart([str(both), str(both)]) == [{}, {}]
    moved = restart([nodes[0], str(tmp_path / "node2")])
    assert moved[1].get("__1_0.distcp") == shards["__1_0.distcp"] and "__0_0.distcp" not in moved[0], moved
    assert ".metadata" not in moved[0], moved  # rank 0 reads it, from its own node


def test_a_full_checkpoint_restart_gets_state_pt_from_rank_0_not_storage_on_another_node(s3_server, tmp_path):
    """2 DDP ranks on their own node-local directories save a full checkpoint (48 MiB ``state.pt``: not packed
    into the manifest), which rank 0 alone writes, so only node 0's tier has ``state.pt``. At a restart on the same
    nodes rank 1 reads none of it from S3: rank 0 sends it over the process group and rank 1 keeps it in node 1's
    tier (checked against the manifest). A restart with rank 0 on a new, empty node reads ``state.pt`` from S3 on
    rank 0 exactly (nothing to send), while rank 1 reads its kept copy. Both load the saved state exactly."""
    from raytrain_events.checkpoint.folder.local_tier import LocalTier
    from raytrain_events.checkpoint.run.peer_fill import matches
    from raytrain_events.storage.run_dir import STATE_FILE

    options = s3_server["storage_options"]
    folder = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}/run/checkpoints"
    nodes = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    saved = run_ranks(2, full_tier_save, folder, 1024, options, nodes)[0]
    info = list_checkpoints(folder, storage_options=options)[-1]
    state = next(f for f in info.files if f.name == STATE_FILE)
    assert not info.packed and state.size > 32 * 2**20, (info.packed, state.size)
    copies = [os.path.join(LocalTier(node, folder, keep=None).root, info.name, STATE_FILE) for node in nodes]
    assert matches(copies[0], state) and not os.path.exists(copies[1])  # rank 0's node only

    def restart(placement):
        loaded = run_ranks(2, full_tier_load, folder, 1024, options, placement)
        for got in loaded:
            for part in ("model", "optim", "ema"):
                for key in saved[part]:
                    torch.testing.assert_close(got[part][key], saved[part][key], rtol=0, atol=0, msg=key)
        return [got["s3"].get(STATE_FILE, 0) for got in loaded]

    assert restart(nodes) == [0, 0]  # before: rank 1 read all of state.pt from S3
    assert matches(copies[1], state)  # kept in node 1's tier
    assert restart([str(tmp_path / "node2"), nodes[1]]) == [state.size, 0]
