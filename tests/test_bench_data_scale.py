"""bench/data_scale.py stays runnable without its cluster: ``--help``, imports, the table, Streaming's refusal.

The bench itself starts a 4-raylet Ray and takes minutes (bench/README.md has its numbers), so only
what can rot cheaply is checked here: the script and its arms module import and parse their
arguments, the side-by-side table computes each ratio against ``ours``, and where MosaicML Streaming
is not installed (it is the ``bench`` extra, not a test dependency) its arm says how to install it.
The mixing arms (``data_scale_mix.py``) without Ray: the three source folders hold every file
once, the `MixtureSource` the ``ours-mix`` arm streams takes every row of each source once per
epoch, and the mixing-cost table pairs each mixing arm with its single-source arm repeat by repeat.
(Their cluster run is not here: ``ray-data-mix`` alone is a `TorchTrainer` fit, 85 s on a tiny
dataset on the loaded machine; bench/README.md has the smoke command.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import data_scale  # noqa: E402
import data_scale_arms  # noqa: E402
import data_scale_mix  # noqa: E402


def test_help_runs_without_ray():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "data_scale.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in ("--files", "--rows-per-file", "--arms", "--repeats", "--no-network", "--json"):
        assert flag in done.stdout
    for arm in ("ours-mix", "ray-data-mix", "streaming-mix"):  # selectable with --arms
        assert arm in done.stdout


def test_table_gives_each_measure_and_its_ratio_to_ours():
    row = dict(rows_per_s_per_worker=1000.0, epoch_rows_per_s_per_worker=500.0, first_batch_s=2.0)
    row.update(resume_first_batch_s=4.0, peak_store_bytes=2**21)
    results = {
        "ours": dict(row, moved_bytes=1000),
        "ray-data": dict(row, rows_per_s_per_worker=2000.0, moved_bytes=500, resume_first_batch_s=12.0),
        "streaming": {"error": "ImportError: not installed"},
    }
    lines = data_scale.table(results, data_bytes=1000).splitlines()
    assert lines[2] == "| ours | 1000 | 500 | 1.000 | 2.00 | 4.00 | 2.0 |"
    assert lines[3] == (
        "| ray-data | 2000 (2.00x) | 500 (1.00x) | 0.500 (0.50x) | 2.00 (1.00x) | 12.00 (3.00x) | 2.0 (1.00x) |"
    )
    assert lines[4] == "| streaming | not run: ImportError: not installed | | | | | |"


def test_repeats_give_medians_and_their_spread():
    runs = [
        dict(rows_per_s_per_worker=r, first_batch_s=f, note="x")
        for r, f in ((900.0, 1.0), (1000.0, 3.0), (1300.0, 2.0))
    ]
    merged = data_scale.aggregate(runs)
    assert merged["rows_per_s_per_worker"] == 1000.0 and merged["first_batch_s"] == 2.0 and merged["repeats"] == 3
    assert merged["spread"]["rows_per_s_per_worker"] == (900.0, 1300.0) and merged["note"] == "x"
    assert data_scale.aggregate([runs[0], {"error": "boom"}]) == {"error": "boom"}
    merged["moved_bytes"] = None  # the network pass was skipped
    line = data_scale.table({"ours": merged}, data_bytes=1000).splitlines()[2]
    assert line == "| ours | 1000 [900-1300] | - | - | 2.00 [1.00-3.00] | - | - |"


def test_streaming_arm_names_the_install_when_streaming_is_missing():
    import importlib.util

    if importlib.util.find_spec("streaming") is not None:  # installed (it may still fail a plain import: torchvision)
        pytest.skip("MosaicML Streaming is installed here (the bench extra)")
    with pytest.raises(ImportError, match=r"-e '\.\[bench\]' && pip install -c constraints.txt --no-deps streaming"):
        data_scale_arms.import_streaming()


def test_mixing_arms_split_the_files_into_three_sources_each_row_chosen_once(tmp_path):
    data = tmp_path / "parquet"
    data.mkdir()
    data_scale.write_parquet(str(data), files=10, rows_per_file=20)
    sources = data_scale_mix.split_sources(str(data), str(tmp_path / "mix"))
    assert list(sources) == ["web", "code", "math"]
    files = [sorted(os.listdir(s["folder"])) for s in sources.values()]
    assert [len(f) for f in files] == [5, 3, 2]  # 0.5 / 0.3 / 0.2 of the files, consecutive
    assert sum(files, []) == sorted(os.listdir(data))
    assert [s["weight"] for s in sources.values()] == [0.5, 0.3, 0.2]
    # ours-mix: the MixtureSource RayTrainer(mixture=...) streams; its epoch is every row of each source once.
    mixed = data_scale_mix.ours_mix_source(sources, global_batch=96)
    assert mixed.count() == 200
    assert list(mixed.plan.epoch_totals(0)) == [sources[n]["rows"] for n in mixed.mixture.names]


def test_mixing_cost_is_each_mixing_arm_over_its_single_source_arm_repeat_by_repeat():
    def run(rows_per_s, first):
        return dict(rows_per_s_per_worker=rows_per_s, epoch_rows_per_s_per_worker=rows_per_s / 2, first_batch_s=first)

    runs = {
        "ours-seek": [run(1000.0, 1.0), run(2000.0, 1.0), run(1000.0, 2.0)],
        "ours-mix": [run(950.0, 1.0), run(2000.0, 1.5), run(1100.0, 2.0)],
        "streaming": [run(1000.0, 1.0)],
        "streaming-mix": [{"error": "ImportError: not installed"}],
        "ray-data-mix": [run(500.0, 3.0)],  # its single-source arm did not run: no ratio
    }
    costs = data_scale_mix.mixing_costs(runs)
    assert list(costs) == ["ours-mix"]
    assert costs["ours-mix"]["rows_per_s_per_worker"] == (1.0, 0.95, 1.1)
    assert costs["ours-mix"]["first_batch_s"] == (1.0, 1.0, 1.5) and costs["ours-mix"]["repeats"] == 3
    lines = data_scale_mix.costs_table(costs).splitlines()
    assert lines[2] == "| ours-mix / ours-seek | 1.00x [0.95-1.10] | 1.00x [0.95-1.10] | 1.00x [1.00-1.50] | - | - |"
    assert data_scale_mix.costs_table({}) is None


def test_table_marks_an_arm_without_mid_epoch_resume():
    row = dict(rows_per_s_per_worker=1000.0, epoch_rows_per_s_per_worker=500.0, first_batch_s=2.0)
    row.update(resume_first_batch_s=4.0, peak_store_bytes=2**21, resume_kind="no mid-epoch resume")
    lines = data_scale.table({"ray-data-mix": row}, data_bytes=1000).splitlines()
    assert lines[2] == "| ray-data-mix | 1000 | 500 | - | 2.00 | no resume; a skip: 4.00 | 2.0 |"
    assert "no mid-epoch resume" in lines[-1]
