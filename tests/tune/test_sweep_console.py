"""`SweepConsole`'s lines from Tune's callback calls, without starting Ray (the sweep tests run it for real)."""

from __future__ import annotations

from types import SimpleNamespace

from ray.tune.schedulers import ASHAScheduler

from raytrain_events.tune.console import SweepConsole


def _console(scheduler=None):
    lines = []
    console = SweepConsole("metrics/eval/accuracy", "max", scheduler, print_fn=lines.append)
    return console, lines


def _trial(trial_id="t1", **config):
    return SimpleNamespace(trial_id=trial_id, config={"algorithms": ["ema"], **config}, last_result=None)


def test_a_finished_trial_shows_its_last_reported_metric_not_the_final_entry_without_it():
    console, lines = _console()
    trial = _trial(lr=0.1)
    console.on_trial_start(0, [], trial)
    console.on_trial_result(0, [], trial, {"time/sample": 64, "time/epoch": 0, "metrics/eval/accuracy": 0.75})
    console.on_trial_result(0, [], trial, {"time/sample": 128, "time/epoch": 1, "train/loss": 0.5, "final": True})
    console.on_trial_complete(0, [], trial)
    assert lines[0] == "[sweep] t1 (ema): started with {'lr': 0.1}"
    assert lines[1] == "[sweep] t1 (ema): reported sample 64, epoch 0, metrics/eval/accuracy 0.75"
    assert lines[2] == "[sweep] t1 (ema): reported sample 128, epoch 1, loss 0.5"
    assert lines[3] == "[sweep] t1 (ema): finished at time/sample=128, metrics/eval/accuracy 0.75"


def test_an_early_stop_names_the_scheduler_as_users_write_it_and_where():
    console, lines = _console(ASHAScheduler(time_attr="time/sample", max_t=1000, grace_period=10))
    trial = _trial()
    console.on_trial_result(0, [], trial, {"time/sample": 10, "time/epoch": 0, "metrics/eval/accuracy": 0.5})
    console.on_trial_complete(0, [], trial)
    assert lines[-1] == (
        "[sweep] t1 (ema): stopped by ASHAScheduler at time/sample=10: metrics/eval/accuracy 0.5 was not among "
        "the highest of the trials that reached that point"
    )


def test_a_late_async_validation_does_not_turn_a_finished_trial_into_a_stopped_one():
    """Async validation results (ray/checkpointing/validation.py) arrive after the final report, at an earlier Timestamp."""
    console, lines = _console(ASHAScheduler(time_attr="time/sample", max_t=1000, grace_period=1))
    trial = _trial()
    console.on_trial_start(0, [], trial)
    console.on_trial_result(0, [], trial, {"time/sample": 128, "time/epoch": 1, "train/loss": 0.5, "final": True})
    late = {"time/sample": 64, "time/epoch": 0, "metrics/eval/accuracy": 0.7, "validation": "async"}
    console.on_trial_result(0, [], trial, late)
    console.on_trial_complete(0, [], trial)
    assert lines[-1] == "[sweep] t1 (ema): finished at time/sample=128, metrics/eval/accuracy 0.7"
