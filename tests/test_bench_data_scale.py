"""bench/data_scale.py stays runnable without its cluster: ``--help``, imports, the table, Streaming's refusal.

The bench itself starts a 4-raylet Ray and takes minutes (bench/README.md has its numbers), so only
what can rot cheaply is checked here: the script and its arms module import and parse their
arguments, the side-by-side table computes each ratio against ``ours``, and where MosaicML Streaming
is not installed (it is the ``bench`` extra, not a test dependency) its arm says how to install it.
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
    try:
        import streaming  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("MosaicML Streaming is installed here (the bench extra)")
    with pytest.raises(ImportError, match=r"-e '\.\[bench\]' && pip install -c constraints.txt --no-deps streaming"):
        data_scale_arms.import_streaming()
