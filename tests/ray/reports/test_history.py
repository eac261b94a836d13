"""The run's history actor (`RunHistory`) on the session's Ray: it alone chooses which replica-group checkpoints are
validated, marks them, and `unfinished_validations` reads the marks."""

from __future__ import annotations


def test_the_history_marks_the_checkpoints_it_validates_and_a_late_save_takes_a_lost_ones_place(ray_cluster):
    from raytrain_events.ray.checkpointing.validation import (
        ASKED_KEY,
        LATE_KEY,
        VALIDATE_KEY,
        AsyncValidation,
        unfinished_validations,
    )
    from raytrain_events.ray.reports.history import RunHistory

    ray = ray_cluster
    validation = AsyncValidation(every=2, resources={"CPU": 0})
    history = RunHistory.remote()
    ray.get(
        history.validate_checkpoints.remote(lambda checkpoint, commit_wait_s: {"path": checkpoint.path}, validation)
    )
    for batch, late_for in [(2, ()), (4, ()), (6, ()), (8, ()), (9, [8]), (10, ()), (12, ())]:
        entry = {"time/batch": batch, "checkpoint_path": f"/r/ckpt-{batch}", VALIDATE_KEY: True}
        if late_for:  # the lead died writing ckpt-8 (the 4th, chosen): the late save ckpt-9 stands in for it
            entry[LATE_KEY] = list(late_for)
        ray.get(history.add.remote(entry))
    entries = ray.get(history.get.remote())["entries"]
    assert [e["time/batch"] for e in entries if e.get(ASKED_KEY)] == [4, 9, 12]  # every 2nd; ckpt-10: the 5th
    assert [e["time/batch"] for e in entries if e.get("checkpoint_lost")] == [8]
    assert not any(VALIDATE_KEY in e for e in entries)
    done = ray.get(ray.get(history.validations.remote()))
    assert [d["path"] for d in done] == ["/r/ckpt-4", "/r/ckpt-9", "/r/ckpt-12"]
    missing = unfinished_validations(entries, validation)  # no validation entry arrived: the three are recorded failed
    assert [e["validated_checkpoint"] for e in missing] == ["ckpt-4", "ckpt-9", "ckpt-12"]
