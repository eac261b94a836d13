"""bench/gpu_suite.py's tiny CPU configuration runs end to end (so the GPU suite never rots)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_suite_tiny_runs_every_part_on_cpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_suite.py"), "--tiny", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["config"]["n_layer"] == 2
    for arm in ("plain", "ours", "fsdp1"):
        assert result[arm]["step_s"] > 0 and result[arm]["tokens_per_s"] > 0
        assert result[arm]["mfu"] is None and result[arm]["syncs_per_step"] is None  # no peak, no CUDA
    assert result["ours_vs_plain"] > 0 and result["fsdp1_vs_plain"] > 0
    ckpt = result["checkpoint"]
    assert ckpt["bytes"] > 1_000_000  # model + AdamW's two moments of a ~0.12M-parameter model
    assert ckpt["save_GBps"] > 0 and ckpt["load_GBps"] > 0 and ckpt["async_block_s"] >= 0
