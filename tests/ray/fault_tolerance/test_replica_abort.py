"""Replica groups on a ring of 6 (no Ray): a group SIGKILLed mid-step costs the survivors the heartbeat
detection and a step or two, not gloo's timeout, whichever survivor is not the dead group's ring neighbour
(`replica_abort.py`).

``k`` processes (`replica_ring.py`), each a replica group built as a Ray worker builds it (torchft's ``Manager``
over `AbortableGloo`, the loop's `CommitOptimizer`), and a real torchft Lighthouse with the run's settings
(`lighthouse_options`: all but one group form a quorum; a dead group is dropped after `HEARTBEAT_TIMEOUT_MS`).
gloo's timeout is 60 s. Once every group committed 3 steps, group 1 SIGKILLs itself between its backward and
the all-reduce. Its ring neighbours (0 and 2) see the closed connection; the others (groups 3, 4 and 5, group 4
two hops from either failing neighbour) do not exchange with it and, before the change,
waited out gloo's 60 s receive timeout, and no quorum formed without them. Now each of them abandons its
all-reduce (the neighbours posted the abort on the quorum's board), every survivor's step fails to commit, it
loses at most 2 steps, and the survivors go on committing steps together while the victim is away.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
VICTIM = 1  # gloo's ring 0-1-...-(k-1)-0: groups 0 and 2 are its neighbours, the others are not
GLOO_TIMEOUT_S = 60.0  # each group's collectives (`replica_ring.py`) and the Lighthouse's join timeout


def _steps(folder: str, group: int) -> list:
    path = os.path.join(folder, f"steps-{group}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [6])  # 4 groups: the Ray run in test_replica_groups.py (a process each costs ~10 s)
def test_a_kill_on_a_ring_costs_the_far_groups_a_step_not_the_gloo_timeout(tmp_path, groups):
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    from raytrain_events.ray.replica_checks import HEARTBEAT_TIMEOUT_MS, lighthouse_options

    GROUPS = groups  # noqa: N806 (the module's constant before the parametrization)
    folder = str(tmp_path)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", **lighthouse_options(GROUPS, GLOO_TIMEOUT_S))
    port = lighthouse.address().rsplit(":", 1)[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    script = os.environ.get("RTE_RING_SCRIPT", os.path.join(HERE, "replica_ring.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(g), str(GROUPS), folder, f"http://127.0.0.1:{port}", str(GLOO_TIMEOUT_S)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(folder, f"err-{g}.log"), "w"),
        )
        for g in range(GROUPS)
    ]
    try:
        together = lambda g: sum(1 for r in _steps(folder, g) if r["committed"] and r["participants"] == GROUPS)  # noqa: E731
        _wait(lambda: all(together(g) >= 3 for g in range(GROUPS)), 240, f"{GROUPS} groups to commit 3 steps")
        open(os.path.join(folder, f"die-{VICTIM}"), "w").close()
        procs[VICTIM].wait(timeout=60)
        killed = time.time()
        survivors = [g for g in range(GROUPS) if g != VICTIM]
        after = lambda g: [  # noqa: E731
            r for r in _steps(folder, g) if r["committed"] and r["participants"] == GROUPS - 1 and r["t"] > killed
        ]
        _wait(lambda: all(len(after(g)) >= 3 for g in survivors), 90, "the survivors to commit 3 steps together")
    finally:
        for p in procs:  # a group may be waiting for a quorum the others left: no clean stop to wait for
            p.kill()
            p.wait()
        lighthouse.shutdown()
    lost_steps, abandoned_at = {}, {}
    for g in survivors:
        records = _steps(folder, g)
        failed = [r for r in records if not r["committed"] and r["t"] > killed - 5]
        assert failed, f"group {g}: the step with the dying group committed: {records}"
        # The failed step ended before gloo's timeout could fire, and so did the survivors' first commit without the
        # victim (counted from that step's start). A step that waited the timeout out measures at least
        # GLOO_TIMEOUT_S by construction, so these hold on any load and fail only if it did (they were < 20 s, a
        # wall-clock bound; seen ~1-5 s). The far groups' abandoned all-reduces (below) say how it ended.
        ended = failed[0]["t"] - failed[0]["started"]
        first = after(g)[0]["t"] - failed[0]["started"]
        print(
            f"group {g}: failed step ended after {ended:.2f} s; first commit of the survivors {first:.2f} s after it began"
        )
        assert ended < GLOO_TIMEOUT_S and first < GLOO_TIMEOUT_S, (g, ended, first)
        # What the kill cost in steps: the step in flight (trained again), and at most one more before the smaller
        # quorum commits (the goal: the heartbeat detection + 2 steps). Counted up to its first commit without the
        # victim; every step after that commits.
        last_whole = max(r["t"] for r in records if r["committed"] and r["participants"] == GROUPS)
        lost = [r for r in records if not r["committed"] and last_whole < r["t"] <= after(g)[0]["t"]]
        assert 1 <= len(lost) <= 2, (g, lost)
        lost_steps[g] = len(lost)
        # The all-reduces abandoned from the last whole step to the first commit without the victim (the counter
        # is the process's: a quorum that changed while the groups started may have had one abandoned before).
        before = max(r["abandoned"] for r in records if r["t"] <= last_whole)
        abandoned_at[g] = max(r["abandoned"] for r in records if r["t"] <= after(g)[0]["t"]) - before
    for g in range(GROUPS):
        neighbour = g in ((VICTIM - 1) % GROUPS, (VICTIM + 1) % GROUPS)
        abandoned = abandoned_at.get(g, 0)
        # Each group that is not the victim's ring neighbour abandoned its all-reduce when the board said a
        # neighbour failed (at 6 groups three of them, one two hops from any failing neighbour). A neighbour
        # usually fails on the closed connection first, but on a loaded machine it may read the other
        # neighbour's post first and abandon. Each abandoned all-reduce is a step that did not commit, so no group
        # abandons more than it lost (at most 2, above): on CI's loaded run a far group (4) abandoned twice.
        if g == VICTIM:
            continue
        if neighbour:
            assert abandoned <= lost_steps[g], (g, abandoned, lost_steps[g])
        else:
            assert 1 <= abandoned <= lost_steps[g], (g, abandoned, lost_steps[g])
    assert HEARTBEAT_TIMEOUT_MS < 20_000
