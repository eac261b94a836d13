"""`Trainer` with `TorchDist` on real spawned gloo ranks (no Ray): exact global counters, one reduction per batch.

Each rank has its own batch size and a short last batch (uneven), rows carry large, varying token
counts (per-batch sums beyond 2**24, which float32 cannot hold exactly), and the counters ride on
DDP's gradient all-reduce. The results must equal the plain sums and today's separate-collective path.
"""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import BATCHES, check_exact_counters, count_collectives, expected_global_samples, run_ranks, train


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (3, 1), (2, 2), (3, 3)])
def test_counters_ride_on_ddp_and_stay_exact(world_size, grad_accum):
    results = run_ranks(train, world_size, grad_accum=grad_accum, epochs=2)
    assert all(r["on_gradients"] for r in results)
    check_exact_counters(results, world_size, epochs=2)


def test_repeated_counters_stay_exact_across_short_batches_and_epochs():
    """Full batches repeat their counters, the short last batch differs, the next epoch repeats again."""
    epochs = 3
    results = run_ranks(train, 2, epochs=epochs, tokens=False)
    assert all(r["on_gradients"] for r in results)
    rows = sum(r["local_rows"] for r in results)
    for r in results:
        assert r["global_samples"] == expected_global_samples(2) * epochs
        assert r["global_tokens"] == [0] * (BATCHES * epochs)
        ts = r["timestamp"]
        assert (ts["batch"], ts["sample"], ts["token"]) == (epochs * BATCHES, epochs * rows, 0)


def test_gradient_path_matches_the_separate_collective():
    on_grads = run_ranks(train, 2, grad_accum=2, epochs=1)
    separate = run_ranks(train, 2, grad_accum=2, epochs=1, on_gradients=False)
    assert not separate[0]["on_gradients"]
    for a, b in zip(on_grads, separate):
        counters = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
        assert {k: a["timestamp"][k] for k in counters} == {k: b["timestamp"][k] for k in counters}
        assert a["global_samples"] == b["global_samples"] and a["global_tokens"] == b["global_tokens"]
        for name, value in a["weights"].items():
            torch.testing.assert_close(value, b["weights"][name])


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_ddp_collectives_run_per_batch(world_size):
    results = run_ranks(count_collectives, world_size)
    for r in results:
        assert len(r["per_batch"]) == len(r["plain_per_batch"]) == 2 * BATCHES
        assert all(counts.get("gloo:all_reduce", 0) >= 1 for counts in r["plain_per_batch"])  # DDP's gradients
        # Batch by batch, the same collectives as a hand-written DDP loop: nothing of the loop's own.
        assert r["per_batch"] == r["plain_per_batch"]
    # The same count with the separate collective shows the test can fail: one more all-reduce per batch.
    separate = run_ranks(count_collectives, 2, on_gradients=False)
    for ours, plain in zip(separate[0]["per_batch"], separate[0]["plain_per_batch"]):
        assert ours["gloo:all_reduce"] == plain["gloo:all_reduce"] + 1
