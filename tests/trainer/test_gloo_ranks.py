"""`Trainer` with `TorchDist` on real spawned gloo ranks (no Ray): exact global counters, one reduction per batch.

Each rank has its own batch size and a short last batch (uneven), rows carry large, varying token
counts (per-batch sums beyond 2**24, which float32 cannot hold exactly), and the counters ride on
DDP's gradient all-reduce. The results must equal the plain sums and today's separate-collective path.
"""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import (
    BATCHES,
    check_exact_counters,
    count_collectives,
    expected_global_samples,
    job_results,
    run_jobs,
    run_ranks,
    train,
)
from mixture_ranks import FOLDER, GLOBAL_BATCH, MIXTURE, ONLINE, ONLINE_FOLDER, SEED, train_mixture
from spike_ranks import quarantined_ids, train_quarantine, train_spike

# Every job of this file, by world size: one spawn per world size runs them all in order (a spawn
# costs each rank a torch import and a gloo rendezvous; ten spawns were most of this file's time).
# The separate-collective jobs patch the Trainer only while they build it (`_separate_collective`).
JOBS = {
    2: {
        "ga1": (train, dict(grad_accum=1, epochs=2)),
        "ga2": (train, dict(grad_accum=2, epochs=2)),
        "repeated": (train, dict(epochs=3, tokens=False)),
        "ga2_1ep": (train, dict(grad_accum=2, epochs=1)),
        "ga2_1ep_separate": (train, dict(grad_accum=2, epochs=1, on_gradients=False)),
        "collectives": (count_collectives, {}),
        "collectives_separate": (count_collectives, dict(on_gradients=False)),
        "mixture": (train_mixture, {}),
        "mixture_crash": (train_mixture, dict(folder=FOLDER, crash_at=9)),  # newest checkpoint: step 5
        "online": (train_mixture, dict(online=True)),
        "online_crash": (train_mixture, dict(online=True, folder=ONLINE_FOLDER, crash_at=12)),  # checkpoint: step 10
        "spike": (train_spike, {}),
    },
    3: {
        "ga1": (train, dict(grad_accum=1, epochs=2)),
        "ga3": (train, dict(grad_accum=3, epochs=2)),
        "collectives": (count_collectives, {}),
        "mixture_resume": (train_mixture, dict(folder=FOLDER)),  # the 2-rank crash's checkpoint
        "online_resume": (train_mixture, dict(online=True, folder=ONLINE_FOLDER)),
        "spike": (train_spike, {}),
        "quarantine": (train_quarantine, {}),
    },
}


@pytest.fixture(scope="module")
def ranks():
    """``ranks(world_size, job)``: that job's per-rank results (each world size spawned once, on first use)."""
    done = {}

    def results(world_size, job):
        if world_size not in done:
            done[world_size] = run_ranks(run_jobs, world_size, jobs=list(JOBS[world_size].values()))
        return job_results(done[world_size], list(JOBS[world_size]).index(job))

    return results


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (3, 1), (2, 2), (3, 3)])
def test_counters_ride_on_ddp_and_stay_exact(ranks, world_size, grad_accum):
    results = ranks(world_size, f"ga{grad_accum}")
    assert all(r["on_gradients"] for r in results)
    check_exact_counters(results, world_size, epochs=2)


def test_repeated_counters_stay_exact_across_short_batches_and_epochs(ranks):
    """Full batches repeat their counters, the short last batch differs, the next epoch repeats again."""
    epochs = 3
    results = ranks(2, "repeated")
    assert all(r["on_gradients"] for r in results)
    rows = sum(r["local_rows"] for r in results)
    for r in results:
        assert r["global_samples"] == expected_global_samples(2) * epochs
        assert r["global_tokens"] == [0] * (BATCHES * epochs)
        ts = r["timestamp"]
        assert (ts["batch"], ts["sample"], ts["token"]) == (epochs * BATCHES, epochs * rows, 0)


def test_gradient_path_matches_the_separate_collective(ranks):
    on_grads = ranks(2, "ga2_1ep")
    separate = ranks(2, "ga2_1ep_separate")
    assert on_grads[0]["on_gradients"] and not separate[0]["on_gradients"]
    for a, b in zip(on_grads, separate):
        counters = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
        assert {k: a["timestamp"][k] for k in counters} == {k: b["timestamp"][k] for k in counters}
        assert a["global_samples"] == b["global_samples"] and a["global_tokens"] == b["global_tokens"]
        for name, value in a["weights"].items():
            torch.testing.assert_close(value, b["weights"][name])


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_ddp_collectives_run_per_batch(ranks, world_size):
    results = ranks(world_size, "collectives")
    for r in results:
        assert len(r["per_batch"]) == len(r["plain_per_batch"]) == 2 * BATCHES
        assert all(counts.get("gloo:all_reduce", 0) >= 1 for counts in r["plain_per_batch"])  # DDP's gradients
        # Batch by batch, the same collectives as a hand-written DDP loop: nothing of the loop's own.
        assert r["per_batch"] == r["plain_per_batch"]
    # The same count with the separate collective shows the test can fail: one more all-reduce per batch.
    separate = ranks(2, "collectives_separate")
    for ours, plain in zip(separate[0]["per_batch"], separate[0]["plain_per_batch"]):
        assert ours["gloo:all_reduce"] == plain["gloo:all_reduce"] + 1


def test_jobs_after_a_separate_collective_job_are_back_on_the_gradients(ranks):
    """Running the jobs in one process is sound: the patch of a separate-collective job does not leak
    into the jobs after it (here the plain count runs after one; its per-batch counts match DDP's)."""
    order = list(JOBS[2])
    assert order.index("ga2_1ep_separate") < order.index("collectives")
    assert all(r["per_batch"] == r["plain_per_batch"] for r in ranks(2, "collectives"))


def test_a_mixture_keeps_its_order_and_counts_on_2_and_3_ranks_and_resumes_across_them(ranks):
    """A 3-source mixture with a stage change: the plan's global order on 2 ranks, per-source counts summed on
    DDP's all-reduce (no collective of their own), and a crash on 2 ranks resumed on 3 that ends exactly."""
    full, crashed = ranks(2, "mixture"), ranks(2, "mixture_crash")
    resumed = ranks(3, "mixture_resume")  # after the 2-rank spawn: it resumes that spawn's checkpoint
    size = MIXTURE.epoch_size
    plan = MIXTURE.plan(seed=SEED, total_samples=2 * size, global_batch=GLOBAL_BATCH)
    expected = [list(pair) for epoch in (0, 1) for pair in plan.rows(epoch, 0, size)]

    def global_order(results):
        return [row for batch in zip(*(r["batches"] for r in results)) for part in batch for row in part]

    assert global_order(full) == expected
    assert all(r["on_gradients"] for r in full + resumed)
    ts = full[0]["timestamp"]
    assert all(r["counts"] == full[0]["counts"] for r in full)  # the same totals on every rank
    assert sum(c["samples"] for c in full[0]["counts"].values()) == ts["sample"] == 2 * size
    assert sum(c["tokens"] for c in full[0]["counts"].values()) == ts["token"]
    assert all(r["crashed"] for r in crashed)
    assert [r["started_at"] for r in resumed] == [5, 5, 5]
    assert global_order(resumed) == expected[5 * GLOBAL_BATCH :]
    counters = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
    for r in resumed:
        assert {k: r["timestamp"][k] for k in counters} == {k: ts[k] for k in counters}
        assert r["counts"] == full[0]["counts"]


def test_an_online_mixture_crashed_on_2_ranks_resumes_on_3_with_the_same_weights_history(ranks):
    """Weights an online policy changes at every eval (each source's loss, synchronized by the eval): every rank
    decides the same, and a crash on 2 ranks resumed on 3 ends with the uninterrupted run's weights history,
    global order, per-source counts and Timestamp."""
    full, crashed = ranks(2, "online"), ranks(2, "online_crash")
    resumed = ranks(3, "online_resume")
    history = full[0]["history"]
    assert len(history) == 2 * ONLINE.epoch_size // GLOBAL_BATCH // 2 - 1  # every eval but the run's last
    assert all(r["history"] == history for r in full + resumed)
    assert history[-1]["new"] != history[0]["old"]

    def global_order(results):
        return [row for batch in zip(*(r["batches"] for r in results)) for part in batch for row in part]

    order = global_order(full)
    final = ONLINE  # the uninterrupted run's order is its final mixture's plan
    for change in history:
        final = final.switched(change["position"], change["new"])
    plan = final.plan(seed=SEED, total_samples=2 * ONLINE.epoch_size)
    assert order == [list(pair) for epoch in (0, 1) for pair in plan.rows(epoch, 0, ONLINE.epoch_size)]
    assert all(r["crashed"] for r in crashed) and [r["started_at"] for r in resumed] == [10, 10, 10]
    assert global_order(resumed) == order[10 * GLOBAL_BATCH :]
    ts = full[0]["timestamp"]
    counters = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
    for r in resumed:
        assert {k: r["timestamp"][k] for k in counters} == {k: ts[k] for k in counters}
        assert r["counts"] == full[0]["counts"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_spike_guard_rolls_every_rank_back_at_the_same_batch(ranks, world_size):
    """A row planted on the last rank only: every rank rolls back at the same batch (the flag rides on the
    loop's per-batch sum), to the same snapshot, skips the same global rows and ends with the same weights."""
    results = ranks(world_size, "spike")
    # Seen at batch 11 on the last rank, agreed at 12 by all, the snapshot of batch 8 restored: batches 9-12.
    for rank, r in enumerate(results):
        assert [(b["spike_batch"], b["restored_batch"], b["from"]) for b in r["rollbacks"]] == [(11, 8, "host")]
        seen = r["rollbacks"][0]["reason"]
        assert ("loss nan is not finite" in seen) if rank == world_size - 1 else (seen == "seen on another rank")
        rows = 8 * world_size
        assert r["skips"] == [[0, 8 * rows, 12 * rows, 4, 0]]
        assert r["trained"] == {"batch": 16, "sample": 16 * rows, "token": 0} and r["sample"] == 20 * rows
        for key, value in r["weights"].items():
            assert torch.isfinite(value).all() and torch.equal(value, results[0]["weights"][key]), (rank, key)


def test_a_mixtures_quarantine_is_counted_alike_on_every_rank_from_the_per_batch_sum(ranks):
    """3 ranks, a 3-source mixture, a quarantine file: every rank's ``State.skipped`` holds all ranks' dropped
    rows, their tokens and rows per source (summed on the loop's per-batch collective), the same everywhere."""
    results = ranks(3, "quarantine")
    held, names = set(quarantined_ids()), list(MIXTURE.names)
    offsets = [sum(MIXTURE.rows(n) for n in names[:i]) for i in range(len(names))]
    dropped = [(rid, n) for r in results for rid, n in r["read"] if rid in held]  # every rank's
    by_source = {}
    for rid, _ in dropped:
        name = names[max(i for i in range(len(names)) if offsets[i] <= rid)]
        by_source[name] = by_source.get(name, 0) + 1
    assert len(by_source) == 3 and all(len({rid for rid, _ in r["read"]} & held) for r in results)
    for r in results:
        assert r["skipped"]["quarantined"] == len(dropped)
        assert r["skipped"]["quarantined_tokens"] == sum(n for _, n in dropped)
        assert r["skipped"]["quarantined_by_source"] == by_source
        assert r["trained"] == results[0]["trained"]
    read_tokens = sum(n for r in results for _, n in r["read"])
    assert results[0]["trained"]["token"] == read_tokens - sum(n for _, n in dropped)
