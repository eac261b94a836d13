"""`pack_tokens` / ``raytrain-events pack``: best_fit (and concat) packed offline into the packed layout,
read back by `PackedTokens` without packing (no Ray: the read tasks' function called in this process).

The pre-packed folder yields exactly the on-the-fly source's sequences (both policies, two shapes:
the flat layout with windows of several row groups, the documents layout with a window per row group
or two; every read several windows), its counts come from the footers, and a resume inside a window
enters the same window at the same sequence. A rerun writes nothing, a lost shard is redone alone.
Refused with a clear message: a seq_len, policy or pad_id other than the files were packed for,
token ids outside the vocabulary, packed and token files in one folder, corrupt runs, a shard of
other options in the output. The CLI through `cli.main.main`. The Ray-level check (stop on 2 workers,
resume on 3) is tests/data/ray/test_packed_run.py's, whose ``code`` source is pre-packed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

from raytrain_events.data.ray.pack_tokens import pack_tokens
from raytrain_events.data.ray.packed_batch import expand_packed
from raytrain_events.data.ray.packed_reads import pack_reads
from raytrain_events.data.ray.packed_source import PackedTokens
from raytrain_events.data.ray.parquet_seek import stream_entry

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packed_data import VOCAB, write_tokens  # noqa: E402

SHAPES = {  # layout, seq_len, window_tokens, longest document, documents per row group
    "flat-several-groups": ("flat", 64, 3000, 60, 200),
    "documents-long": ("documents", 128, 3000, 128, 300),
}


@pytest.fixture(scope="module")
def token_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    out = {}
    for name, (layout, _, _, longest, docs) in SHAPES.items():
        paths, _ = write_tokens(
            str(root / name), files=4, groups=4, docs_per_group=docs, seed=3, longest=longest, layout=layout
        )
        out[name] = os.path.dirname(paths[0])
    return root, out


def _both(root, folders, shape, policy, **kw):
    layout, seq, window, _, _ = SHAPES[shape]
    fly = PackedTokens(folders[shape], seq_len=seq, policy=policy, window_tokens=window, **kw)
    out = str(root / f"packed-{shape}-{policy}")
    if not os.path.exists(out):
        pack_tokens(folders[shape], out, seq_len=seq, policy=policy, window_tokens=window, windows_per_shard=2)
    return fly, PackedTokens(out, seq_len=seq, policy=policy, **kw), out


@pytest.mark.parametrize("policy", ["best_fit", "concat"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prepacked_sequences_equal_the_on_the_fly_ones(token_folders, shape, policy) -> None:
    root, folders = token_folders
    fly, pre, _ = _both(root, folders, shape, policy, vocab_size=VOCAB)
    assert pre.layout == "packed" and len(pre.windows) >= 5
    assert (pre.window_sequences, pre.real_tokens, pre.documents) == (
        fly.window_sequences,
        fly.real_tokens,
        fly.documents,
    )
    assert pre.schema.equals(fly.schema) and pre.order(5, 1) == fly.order(5, 1)
    if shape.startswith("flat"):
        assert all(b - a > 1 for a, b in fly.windows)  # windows of several row groups
    for seed in (None, 5):
        reads = pre.reads(pre.order(seed, 0))
        assert max(map(len, reads)) > 1  # several windows per read
        for group in reads:
            a, b = pack_reads([fly.window_args(w) for w in group]), pack_reads([pre.window_args(w) for w in group])
            assert a.equals(b)
            assert expand_packed([a])[0].equals(expand_packed([b])[0])


def test_prepacked_cu_seqlens_batches_equal_the_on_the_fly_ones(token_folders) -> None:
    """``document_format="cu_seqlens"`` over a pre-packed folder: the same blocks and the same rank tensors as on
    the fly (the format rides in the block's metadata from either read path)."""
    import torch

    from raytrain_events.data.ray.packed_batch import packed_tensors

    root, folders = token_folders
    fly, pre, _ = _both(root, folders, "flat-several-groups", "best_fit", document_format="cu_seqlens")
    assert pre.schema.equals(fly.schema) and "cu_seqlens" in pre.schema.names
    for group in pre.reads(pre.order(5, 0))[:3]:
        a, b = pack_reads([fly.window_args(w) for w in group]), pack_reads([pre.window_args(w) for w in group])
        assert a.equals(b) and a.schema.metadata == b.schema.metadata
        left, right = packed_tensors([a.slice(3, 20)]), packed_tensors([b.slice(3, 20)])
        assert set(left) == set(right) and "cu_seqlens" in left
        assert all(torch.equal(left[k], right[k]) for k in left)


def test_resume_inside_a_window_enters_it_at_the_same_sequence(token_folders) -> None:
    root, folders = token_folders
    fly, pre, _ = _both(root, folders, "flat-several-groups", "best_fit")
    order = pre.order(9, 2)
    counts = [pre.window_sequences[w] for w in order]
    position = sum(counts[:3]) + counts[3] // 2  # inside the epoch's fourth window
    start, first, _ = stream_entry(counts, position, 0)
    assert start == 3 and first < position
    rows = {}
    for name, source in (("fly", fly), ("pre", pre)):
        table = expand_packed([pack_reads([source.window_args(order[start])])])[0]
        rows[name] = table.slice(position - first)
    assert rows["fly"].equals(rows["pre"]) and rows["pre"].num_rows == counts[3] - counts[3] // 2


def test_rerun_writes_nothing_and_a_lost_shard_is_redone(token_folders, tmp_path) -> None:
    _, folders = token_folders
    out = str(tmp_path / "p")
    kw = {"seq_len": 64, "policy": "best_fit", "window_tokens": 3000, "windows_per_shard": 2}
    first = pack_tokens(folders["flat-several-groups"], out, **kw)
    assert first["written"] >= 3 and first["skipped"] == 0
    times = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)}
    assert pack_tokens(folders["flat-several-groups"], out, **kw) == {
        **first,
        "written": 0,
        "skipped": first["written"],
    }
    os.remove(os.path.join(out, "part-00001.parquet"))
    assert pack_tokens(folders["flat-several-groups"], out, **kw)["written"] == 1
    assert sorted(times) == sorted(os.listdir(out))
    assert all(os.stat(os.path.join(out, p)).st_mtime_ns == t for p, t in times.items() if p != "part-00001.parquet")
    with pytest.raises(FileExistsError, match="another output folder, or delete it"):
        pack_tokens(folders["flat-several-groups"], out, **{**kw, "policy": "concat"})
    shutil.copy(os.path.join(out, "part-00000.parquet"), os.path.join(out, "part-00099.parquet"))
    with pytest.raises(FileExistsError, match=r"holds \['part-00099.parquet'\] besides this job's"):
        pack_tokens(folders["flat-several-groups"], out, **kw)


def test_refusals(token_folders, tmp_path) -> None:
    root, folders = token_folders
    _, _, out = _both(root, folders, "flat-several-groups", "best_fit")
    with pytest.raises(
        ValueError, match=r"seq_len=64, not seq_len=32 as asked. Fix: PackedTokens\(\.\.\., seq_len=64\)"
    ):
        PackedTokens(out, seq_len=32, policy="best_fit")
    with pytest.raises(ValueError, match=r"policy='best_fit', not policy='concat'.*raytrain-events pack"):
        PackedTokens(out, seq_len=64)
    with pytest.raises(ValueError, match="pad_id=0, not pad_id=5"):
        PackedTokens(out, seq_len=64, policy="best_fit", pad_id=5)
    with pytest.raises(ValueError, match="window_tokens=3000, not window_tokens=4000"):
        PackedTokens(out, seq_len=64, policy="best_fit", window_tokens=4000)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 100\)"):
        PackedTokens(out, seq_len=64, policy="best_fit", vocab_size=100)
    with pytest.raises(ValueError, match="already packed"):
        pack_tokens(out, str(tmp_path / "again"), seq_len=64)
    mixed = str(tmp_path / "mixed")
    shutil.copytree(out, mixed)
    token_file = os.path.join(folders["flat-several-groups"], "part-00.parquet")
    shutil.copy(token_file, os.path.join(mixed, "part-99999.parquet"))
    with pytest.raises(ValueError, match="not a packed token file .*'flat' layout.* among packed ones"):
        PackedTokens(mixed, seq_len=64, policy="best_fit")
    shutil.copy(os.path.join(out, "part-00000.parquet"), os.path.join(tmp_path, "zz.parquet"))
    with pytest.raises(ValueError, match="one PackedTokens reads one layout"):
        PackedTokens([token_file, os.path.join(tmp_path, "zz.parquet")], seq_len=64, policy="best_fit")


def test_packed_files_read_as_plain_rows_are_refused_before_ray_starts(token_folders, monkeypatch) -> None:
    import raytrain_events.ray.cluster as cluster
    from raytrain_events import RayTrainer
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from tests.bad_input_helpers import ray_kwargs

    root, folders = token_folders
    _, _, out = _both(root, folders, "flat-several-groups", "best_fit")

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started: the packed rows should have been refused before")

    monkeypatch.setattr(cluster, "ensure_ray", refuse)
    with pytest.raises(ValueError, match=r"reads .* a packed token file .*Fix: .*PackedTokens\('.*', seq_len=\.\.\.\)"):
        RayTrainer(**ray_kwargs(datasets={"train": ParquetRowGroups(out)})).fit()


def test_corrupt_runs_are_refused_at_the_read(token_folders, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, folders = token_folders
    _, _, out = _both(root, folders, "flat-several-groups", "best_fit")
    bad = str(tmp_path / "bad")
    shutil.copytree(out, bad)
    path = os.path.join(bad, "part-00000.parquet")
    file = pq.ParquetFile(path)
    tables = [file.read_row_group(g) for g in range(file.num_row_groups)]
    lengths = np.frombuffer(tables[0].column("run_lengths")[0].as_py(), dtype="<i4").copy()
    lengths[3] += 1  # one run a token longer: its sequence's runs no longer sum to its num_tokens
    tables[0] = tables[0].set_column(
        tables[0].schema.get_field_index("run_lengths"), "run_lengths", pa.array([lengths.tobytes()], pa.large_binary())
    )
    with pq.ParquetWriter(
        path, file.schema_arrow, use_dictionary=False, write_statistics=True, compression="none"
    ) as w:
        for t in tables:
            w.write_table(t)
    source = PackedTokens(bad, seq_len=64, policy="best_fit")
    with pytest.raises(ValueError, match="a corrupt packed file. Fix: pack it again"):
        pack_reads([source.window_args(0)])
    pack_reads([source.window_args(1)])  # the other windows read


def test_the_pack_command(token_folders, tmp_path, capsys) -> None:
    from raytrain_events.cli.main import main

    root, folders = token_folders
    out = str(tmp_path / "cli")
    argv = ["pack", folders["documents-long"], out, "--seq-len", "128", "--window-tokens", "3000"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    fly, pre, _ = _both(root, folders, "documents-long", "best_fit")
    assert (
        summary["written"] == 1
        and summary["sequences"] == fly.count() == PackedTokens(out, seq_len=128, policy="best_fit").count()
    )
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["written"] == 0
    assert main(argv + ["--policy", "concat"]) != 0  # other options into the same folder
    assert "delete it to redo" in capsys.readouterr().err
