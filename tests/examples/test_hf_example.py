"""examples/hf_causal_lm.py: a Hugging Face causal LM on a Ray Train worker, its duration counted in real tokens."""

from __future__ import annotations

import pytest

from tests.example_scripts import load_example

# Measured on the shared 2-core machine (load ~7): ray.init 14 s (once per session: the shared
# `ray_cluster`), the run 63 s: transformers' import on the worker ~10 s, the 9 batches ~1.5 s (timed in
# one process), the rest Ray Train's controller, worker group and Ray Data start-up, as for any
# RayTrainer run here. The 7.6 min measured before was probably the old `ray_cluster`, which could join
# another helper's Ray instance and wait for its CPUs; it now starts its own. So it runs by default.
pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("transformers")


def test_causal_lm_on_ray_stops_at_its_token_budget(ray_cluster, tmp_path):
    example = load_example("hf_causal_lm.py", "hf_causal_lm")
    result = example.run("3000tok", num_workers=1, storage=str(tmp_path), rows=64)
    tokens = result.timestamp.token.value
    most_per_batch = 16 * example.LENGTH
    assert 3000 <= tokens < 3000 + most_per_batch  # stopped at the first batch reaching the budget
    losses = [e["train/loss"] for e in result.history if "train/loss" in e]
    assert losses and all(loss == loss for loss in losses)  # reported from the worker, finite
    # Tokens counted from the attention mask, not the padded shape: fewer than batches * 16 * LENGTH.
    assert tokens < result.timestamp.batch.value * most_per_batch
