"""The chaos soak at CI size: a node lost, a rank hung, a preemption notice and a node added, one run.

It is also the elastic test: the group shrinks 3 -> 2 on a plain node loss (Ray's failure path),
2 -> 1 on a drained node, and grows back 1 -> 2 when a node is added, each size one unbroken stretch.

An elastic ``(1, 3)`` group on a 3-node ``ray.cluster_utils.Cluster`` (its own Ray, so it runs in a
subprocess: ``chaos_run.py``, which also runs the longer opt-in soak). The run must end as an
uninterrupted one would (the exact Timestamp, every row once per epoch: checked in the script),
and the run directory must say what happened: the hang's stack dumps naming the stopped rank, the
notice's committed checkpoint, and goodput with each restart's cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(1500)
def test_chaos_soak_ends_exact_and_reports_goodput_with_causes(tmp_path):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "chaos_run.py"), str(tmp_path), "--plan", "remove,hang,notice,add"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CHAOS_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(lines[-1].split(" ", 1)[1])
    told = "\n".join(line for line in proc.stdout.splitlines() if line.startswith(("CHAOS ", "Chaos soak")))
    events = {e["kind"]: e for e in result["events"]}
    assert [e["kind"] for e in result["events"]] == result["plan"] == ["remove", "hang", "notice", "add"], told
    assert not any("skipped" in e for e in result["events"]), told
    assert result["timestamp"] == result["expected"], told  # exact through four failures and three resizes

    # The group shrank with each node it lost and grew back when one came: 3 -> 2 -> 1 -> 2 workers.
    # The strict sequence (each size one unbroken stretch) also proves what a plain node loss and a
    # re-add alone would: Ray's failure path (remove) and its scale-up path (add) on an elastic group.
    worlds = result["worlds"]  # the group size that trained each global batch, in order
    assert events["remove"]["world"] == 3 and events["notice"]["world"] == 2, told
    stretches = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    # (A start below 3 workers on a loaded machine, grown by Ray before the chaos began, comes first.)
    first = stretches.index(3)
    assert stretches[first:] == [3, 2, 1, 2] and all(w < 3 for w in stretches[:first]), (worlds, told)

    # The hang: every other rank dumped its stacks and named the stopped one.
    (hang,) = result["hangs"]
    assert hang["slowest_rank"] == events["hang"]["rank"] and hang["frame"] is None
    others = [f"rank-{r}.txt" for r in range(events["hang"]["world"]) if r != events["hang"]["rank"]]
    assert sorted(f for f in os.listdir(_hang_dir(tmp_path)) if f.startswith("rank-")) == others
    summary = open(os.path.join(_hang_dir(tmp_path), "summary.txt")).read()
    assert f"Slowest rank: {events['hang']['rank']} (no stack dump" in summary, summary

    # The notice: the ranks agreed on a save at the next batch and committed it before the node went.
    (notice,) = result["preemptions"]
    assert notice["cause"] == "preemption notice" and not notice["stopping"]
    assert notice["saved_batch"] == notice["notice_batch"] + 1 and 0 < notice["notice_to_commit_s"] < 30

    # Goodput with each restart's cause, printed for the person who runs it.
    good = result["goodput"]
    assert 0 < good["goodput"] <= 1
    causes = [r["cause"] for r in good["restarts"]]
    assert any(c.startswith(f"hang: rank {events['hang']['rank']}, frozen or stopped") for c in causes), causes
    assert any(c.startswith("preemption: preemption notice") for c in causes), causes
    # The node's removal: with the errors the controller's failure record holds, where it has one (the first poll
    # after it may see only a survivor's collective failing: which rank is named is Ray's timing, not checked).
    assert any(c.startswith("a worker or node was lost") for c in causes), causes
    # Every failure the controller recorded is counted in a restart (the run ended well: none after the last
    # group's start). Not every restart is one: Ray's elastic policy may resize the group on a lost node before a
    # poll sees the death (no record: that restart's cause comes from the run's own records, as before).
    starts = [a["start_wall"] for a in good["attempts"]]
    assert result["failures"], result["failures"]
    for failure in result["failures"]:
        i = next((i for i in range(len(starts) - 1) if starts[i] < failure["wall"] <= starts[i + 1]), None)
        assert i is not None, ("a failure outside every restart", failure, starts)
        inside = [f for f in result["failures"] if starts[i] < f["wall"] <= starts[i + 1]]
        assert good["restarts"][i]["failures"] == len(inside), (i, result["failures"], good["restarts"])
    assert any(c.startswith("resized: the group grew from 1 to 2 workers") for c in causes), causes
    assert all(r["lost_s"] >= 0 for r in good["restarts"])
    assert "Chaos soak: 4 events" in proc.stdout and "goodput" in proc.stdout


def _hang_dir(tmp_path) -> str:
    root = tmp_path / "runs" / "chaos" / "hangs"
    (only,) = os.listdir(root)  # one hang, one folder
    return str(root / only)
