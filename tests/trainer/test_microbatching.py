"""Auto microbatching (``grad_accum="auto"``): a simulated device OOM doubles the microbatches and retries.

The proofs: the batch's result after retries is bit-for-bit the run that started with the final
setting (no gradient of a failed attempt survives); on two gloo ranks where only one rank runs out
of memory both retry at the same batch and stay identical; the value is saved and reused on resume.
"""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import job_results, run_jobs, run_ranks
from oom_ranks import BATCH, ROWS, OOMModel, Recorder, make_trainer, train_auto

from raytrain_events import Callback, Event
from raytrain_events.checkpoint.config import CheckpointConfig


class Losses(Callback):
    def __init__(self) -> None:
        self.losses = []

    def batch_end(self, state, logger):
        self.losses.append(state.loss.item())


def make(limit=None, grad_accum="auto", *, callbacks=(), loggers=(), checkpoint=None, epochs=2):
    model = OOMModel(limit)
    trainer = make_trainer(
        model,
        epochs=epochs,
        grad_accum=grad_accum,
        callbacks=list(callbacks),
        loggers=list(loggers),
        checkpoint=checkpoint,
    )
    return trainer, model


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_auto_doubles_until_it_fits_and_equals_starting_there():
    recorder, losses = Recorder(), Losses()
    trainer, model = make(limit=4, callbacks=[losses], loggers=[recorder])
    trainer.fit()
    assert trainer.state.grad_accum == 4
    # First batch: 16 rows fail, 2 x 8 fail, then 4 x 4; afterwards 4 microbatches straight away.
    assert model.forward_rows[:7] == [16, 8, 4, 4, 4, 4, 4]
    assert all(rows == 4 for rows in model.forward_rows[3:])
    assert [m["trainer/grad_accum"] for m in recorder.metrics if "trainer/grad_accum" in m] == [2, 4]
    steps = 2 * ROWS // BATCH
    assert trainer.state.timestamp.get_value("ba") == steps
    assert trainer.state.timestamp.get_value("sp") == 2 * ROWS  # counted once, not once per attempt

    fixed_losses = Losses()
    fixed, fixed_model = make(limit=4, grad_accum=4, callbacks=[fixed_losses])
    fixed.fit()
    assert losses.losses == fixed_losses.losses
    for name, value in weights(fixed_model).items():
        assert torch.equal(weights(model)[name], value), name


class OOMAfterFirstBackward(Callback):
    """Raises a device OOM after the first microbatch's backward, once, while grad_accum == 2:
    its gradient is already accumulated, so a retry that kept it would differ from a clean start."""

    def __init__(self) -> None:
        self.calls = 0
        self.fired = False

    def run_event(self, event, state, logger):
        if event is Event.BEFORE_TRAIN_BATCH:
            self.calls = 0
        if event is Event.AFTER_BACKWARD and state.grad_accum == 2 and not self.fired:
            self.calls += 1
            if self.calls == 1:
                self.fired = True
                raise torch.OutOfMemoryError("simulated OOM in the second microbatch's backward")


def test_gradients_of_the_failed_attempt_are_dropped():
    trainer, model = make(limit=8, callbacks=[OOMAfterFirstBackward()])
    trainer.fit()
    assert trainer.state.grad_accum == 4
    fixed, fixed_model = make(grad_accum=4)
    fixed.fit()
    for name, value in weights(fixed_model).items():
        assert torch.equal(weights(model)[name], value), name


def test_no_oom_keeps_one_microbatch_and_matches_the_plain_loop():
    trainer, model = make(limit=None)
    trainer.fit()
    plain, plain_model = make(limit=None, grad_accum=1)
    plain.fit()
    assert trainer.state.grad_accum == 1
    for name, value in weights(plain_model).items():
        assert torch.equal(weights(model)[name], value), name


def test_out_of_memory_at_one_sample_fails_with_the_fix():
    trainer, _ = make(limit=0)
    with pytest.raises(RuntimeError, match="microbatches of one sample.*Lower batch_size"):
        trainer.fit()


def test_a_plain_grad_accum_does_not_catch_oom():
    trainer, _ = make(limit=4, grad_accum=1)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit()


@pytest.mark.parametrize("bad", ["AUTO", "max", 0, 1.5, True])
def test_bad_grad_accum_names_auto(bad):
    with pytest.raises(ValueError, match="or 'auto'"):
        make(grad_accum=bad)


def test_the_found_value_is_checkpointed_and_reused_on_resume(tmp_path):
    folder = str(tmp_path / "run" / "checkpoints")
    config = dict(save_folder=folder, save_every_n_seconds=None, save_final=True)
    first, _ = make(limit=4, checkpoint=CheckpointConfig(**config), epochs=1)
    first.fit()
    assert first.state.grad_accum == 4
    recorder = Recorder()
    resumed, resumed_model = make(
        limit=4, loggers=[recorder], checkpoint=CheckpointConfig(autoresume=True, **config), epochs=2
    )
    assert resumed.state.grad_accum == 4  # before training: no OOM needed to find it again
    resumed.fit()
    assert resumed.state.timestamp.get_value("ep") == 2
    assert resumed_model.forward_rows and all(rows == 4 for rows in resumed_model.forward_rows)
    assert not [m for m in recorder.metrics if "trainer/grad_accum" in m]
    # A fixed grad_accum is the user's choice: a checkpoint does not override it.
    other = CheckpointConfig(save_folder=str(tmp_path / "other" / "checkpoints"), load_from=folder)
    fixed, _ = make(limit=None, grad_accum=2, checkpoint=other)
    assert fixed.state.grad_accum == 2


def test_two_ranks_where_only_one_runs_out_of_memory():
    # One spawn for both runs: the fixed grad_accum=4 one first, then the one that runs out of memory.
    ranks = run_ranks(
        run_jobs,
        2,
        jobs=[(train_auto, {"limits": [None, None], "grad_accum": 4}), (train_auto, {"limits": [None, 4]})],
    )
    fixed, auto = job_results(ranks, 0), job_results(ranks, 1)
    # Rank 0 never ran out, but retried with rank 1 at the same batch: both ended at 4.
    assert [r["grad_accum"] for r in auto] == [4, 4]
    assert auto[0]["forward_rows"][:7] == [16, 8, 8, 4, 4, 4, 4]  # rank 0's first two attempts succeeded locally
    assert auto[1]["forward_rows"][:3] == [16, 8, 4]
    assert auto[0]["timestamp"]["sample"] == auto[1]["timestamp"]["sample"] == 2 * 2 * ROWS
    for name, value in auto[0]["weights"].items():
        torch.testing.assert_close(auto[1]["weights"][name], value, rtol=0, atol=0)
    # The same as both ranks starting with grad_accum=4 under DDP.
    for name, value in fixed[0]["weights"].items():
        torch.testing.assert_close(auto[0]["weights"][name], value)
