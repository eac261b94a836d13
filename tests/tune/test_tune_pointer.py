"""Checkpoint pointers (what trials report to Tune instead of their checkpoints), without Ray."""

from __future__ import annotations

import json
import os

import pytest

from raytrain_events.tune.pointer import (
    POINTER_FILE,
    CheckpointPointer,
    pointer_from_entry,
    read_pointer,
    write_pointer,
)


def test_an_entry_naming_a_checkpoint_gives_its_url_and_exact_counters(tmp_path):
    entry = {
        "time/epoch": 1,
        "time/batch": 12,
        "time/sample": 384,
        "time/token": 0,
        "checkpoint_path": "bucket/sweep/trial_a/train/checkpoints/ckpt-12-ab12",
    }
    algorithms = [{"name": "label_smoothing", "smoothing": 0.1}]
    pointer = pointer_from_entry(entry, "s3://bucket/sweep/trial_a/train", "trial_a", "train", algorithms)
    assert pointer == CheckpointPointer(
        url="s3://bucket/sweep/trial_a/train/checkpoints/ckpt-12-ab12",  # the scheme comes from the run URL
        counters={"epoch": 1, "batch": 12, "sample": 384, "token": 0},
        trial_folder="trial_a",
        run_name="train",
        algorithms=algorithms,
    )
    assert pointer.name == "ckpt-12-ab12"
    assert pointer_from_entry({"time/batch": 3}, "s3://b/r", "trial_a", "train", []) is None

    path = write_pointer(str(tmp_path / "ckpt"), pointer)
    assert os.listdir(tmp_path / "ckpt") == [POINTER_FILE] and os.path.getsize(path) < 1000  # no model bytes
    assert read_pointer(str(tmp_path / "ckpt")) == pointer


def test_a_folder_without_a_pointer_or_a_torn_one_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="not reported by a raytrain_events sweep trial"):
        read_pointer(str(tmp_path))
    (tmp_path / POINTER_FILE).write_text(json.dumps({"url": "s3://b/c"}))
    with pytest.raises(ValueError, match="lacks counters, run_name, trial_folder"):
        read_pointer(str(tmp_path))


def _spec(**kw):
    import torch

    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.ray.spec import RunSpec

    return RunSpec(
        model=lambda config: torch.nn.Linear(2, 2),
        optimizers=lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
        datasets=lambda config: {"train": None},
        max_duration="2ep",
        checkpoint=kw.pop("checkpoint", CheckpointConfig(save_interval="4ba", keep=2)),
        **kw,
    )


def test_a_copied_trial_starts_a_new_run_that_fully_loads_the_donor_and_records_its_lineage(tmp_path):
    from raytrain_events.tune.results import TRIAL_RUN_NAME
    from raytrain_events.tune.trial import TrialSetup, read_lineage, run_to_continue, trial_retention_and_loggers

    setup = TrialSetup(spec=_spec(), experiment_url=str(tmp_path), storage_options={}, keep_every_checkpoint=True)
    trial_url = str(tmp_path / "trial_b")
    donor = CheckpointPointer(
        url=str(tmp_path / "trial_a/train/checkpoints/ckpt-8-aa"),
        counters={"epoch": 1, "batch": 8, "sample": 256, "token": 0},
        trial_folder="trial_a",
        run_name="train",
        algorithms=[],
    )
    spec = trial_retention_and_loggers(_spec(algorithms=["label_smoothing"]), {}, "trial_b", setup)
    assert (
        spec.checkpoints.checkpoint.keep is None and spec.checkpoints.checkpoint.keep_best is None
    )  # under PBT nothing is pruned

    assert run_to_continue(spec, None, "trial_b", ["label_smoothing"], trial_url, setup) == (TRIAL_RUN_NAME, spec)
    own = CheckpointPointer(**{**donor.__dict__, "trial_folder": "trial_b", "run_name": "from-x"})
    assert run_to_continue(spec, own, "trial_b", [], trial_url, setup) == ("from-x", spec)  # a restart resumes
    assert read_lineage(trial_url, {}) == []

    run_name, copied = run_to_continue(spec, donor, "trial_b", ["label_smoothing"], trial_url, setup)
    assert run_name == "from-trial_a-ckpt-8-aa"
    assert (
        copied.checkpoints.checkpoint.load_from == donor.url
        and copied.checkpoints.checkpoint.load_weights_only is False
    )
    step = {
        "run_name": run_name,
        "copied_trial": "trial_a",
        "checkpoint": donor.url,
        "counters": donor.counters,
        "from_algorithms": [],
        "algorithms": ["label_smoothing"],
    }
    assert read_lineage(trial_url, {}) == [step]
    run_to_continue(spec, donor, "trial_b", ["label_smoothing"], trial_url, setup)  # restarted before reporting
    assert read_lineage(trial_url, {}) == [step]  # recorded once

    with pytest.raises(ValueError, match="saves none"):
        run_to_continue(_spec(checkpoint=None), donor, "trial_b", [], trial_url, setup)


def test_a_mixture_copy_records_the_donors_weights_and_its_own_in_the_lineage(tmp_path):
    """The pointer carries the saving trial's mixture weights; the copy's lineage step names both."""
    from raytrain_events.tune.pointer import pointer_from_entry, read_pointer, write_pointer
    from raytrain_events.tune.trial import TrialSetup, read_lineage, run_to_continue

    donor_weights = {"help": 0.8, "noise": 0.1, "small": 0.1}
    entry = {"checkpoint_path": "x/ckpt-8-aa", "time/sample": 256, "time/batch": 8}
    pointer = pointer_from_entry(entry, str(tmp_path / "trial_a/train"), "trial_a", "train", [], donor_weights)
    write_pointer(str(tmp_path / "p"), pointer)
    assert read_pointer(str(tmp_path / "p")).mixture == donor_weights

    setup = TrialSetup(spec=_spec(), experiment_url=str(tmp_path), storage_options={}, keep_every_checkpoint=True)
    explored = {"help": 0.7, "noise": 0.1, "small": 0.2}
    spec = _spec(config={"mixture": explored})
    run_to_continue(spec, read_pointer(str(tmp_path / "p")), "trial_b", [], str(tmp_path / "trial_b"), setup)
    (step,) = read_lineage(str(tmp_path / "trial_b"), {})
    assert step["from_mixture"] == donor_weights and step["mixture"] == explored
    assert step["counters"]["sample"] == 256


def test_a_mixture_copy_trains_on_the_donors_mixture_switched_at_its_checkpoint(tmp_path):
    """The copy's RunSpec.mixture: the donor run's mixture (from the pointer) switched at the checkpoint's sample.

    A chain of copies keeps every switch; a restart of the copy resumes on its own run's mixture;
    unchanged weights (PBT over lr only) keep the donor's mixture as it was.
    """
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.tune.simplex import trial_mixture
    from raytrain_events.tune.trial import TrialSetup, read_lineage, run_to_continue, trial_spec

    base = Mixture(sources={"help": 600, "noise": 600, "small": 600}, weights={"help": 1, "noise": 1, "small": 1})
    setup = TrialSetup(
        spec=_spec(mixture=base),
        experiment_url=str(tmp_path),
        storage_options={},
        keep_every_checkpoint=True,
    )
    donor_weights = {"help": 0.8, "noise": 0.1, "small": 0.1}
    explored = {"help": 0.7, "noise": 0.1, "small": 0.2}
    donor_run = trial_spec(setup.spec, {"mixture": donor_weights}).data.mixture
    entry = {"checkpoint_path": "x/ckpt-8-aa", "time/sample": 256, "time/batch": 8}
    pointer = pointer_from_entry(
        entry, str(tmp_path / "trial_a/train"), "trial_a", "train", [], donor_weights, donor_run
    )
    write_pointer(str(tmp_path / "p"), pointer)
    pointer = read_pointer(str(tmp_path / "p"))
    assert pointer.run_mixture == donor_run

    spec = trial_spec(setup.spec, {"mixture": explored})
    run_name, copied = run_to_continue(spec, pointer, "trial_b", [], str(tmp_path / "trial_b"), setup)
    switched = trial_mixture(base, donor_weights).switched(256, explored)
    assert Mixture.from_dict(copied.data.mixture) == switched and switched.switches == ("256sp",)
    (step,) = read_lineage(str(tmp_path / "trial_b"), {})
    assert step["switched_at_sample"] == 256 and step["mixture"] == explored

    # The copy's own pointer (a restart, or a later copy of the copy) carries the switched mixture.
    own = CheckpointPointer(
        **{**pointer.__dict__, "trial_folder": "trial_b", "run_name": run_name, "run_mixture": copied.data.mixture}
    )
    assert (
        run_to_continue(spec, own, "trial_b", [], str(tmp_path / "trial_b"), setup)[1].data.mixture
        == copied.data.mixture
    )
    later = CheckpointPointer(**{**own.__dict__, "counters": {**own.counters, "sample": 384}, "mixture": explored})
    again = {"help": 0.5, "noise": 0.1, "small": 0.4}
    _, chained = run_to_continue(
        trial_spec(setup.spec, {"mixture": again}), later, "trial_c", [], str(tmp_path / "trial_c"), setup
    )
    assert Mixture.from_dict(chained.data.mixture) == switched.switched(384, again)
    assert Mixture.from_dict(chained.data.mixture).continues(switched)  # the checkpoint's mixture: the load accepts it

    # PBT over other keys: the copy takes the donor's weights and keeps the donor's mixture unchanged.
    _, same = run_to_continue(
        trial_spec(setup.spec, {"mixture": donor_weights}), pointer, "trial_d", [], str(tmp_path / "trial_d"), setup
    )
    assert same.data.mixture == donor_run


def test_pbt_scheduler_measures_global_samples_and_mutates_sets_and_lr():
    from ray.tune.schedulers import PopulationBasedTraining

    from raytrain_events.tune import algorithm_sets_grid, pbt_scheduler

    sets = [[], ["label_smoothing"]]
    for given in (sets, algorithm_sets_grid(sets)):
        pbt = pbt_scheduler("512sp", algorithm_sets=given, lr=[0.1, 0.3])
        assert isinstance(pbt, PopulationBasedTraining)
        assert pbt._time_attr == "time/sample" and pbt._perturbation_interval == 512
        assert pbt._hyperparam_mutations == {"algorithms": sets, "lr": [0.1, 0.3]}
    assert pbt_scheduler("1000tok", lr=[0.1, 0.2])._time_attr == "time/token"
    with pytest.raises(ValueError, match="global samples"):
        pbt_scheduler("2ep", lr=[0.1])
    with pytest.raises(ValueError, match="at least two sets"):
        pbt_scheduler("512sp", algorithm_sets=[[]])
    with pytest.raises(ValueError, match="something to mutate"):
        pbt_scheduler("512sp")


def tunes_own_pbt():
    """Tune's own asynchronous PBT, as `pbt_scheduler` configures ours: what the PBT tests tell ours apart from."""
    from ray.tune.schedulers import PopulationBasedTraining

    return PopulationBasedTraining(
        time_attr="time/sample",
        metric="loss",
        mode="min",
        perturbation_interval=512,
        hyperparam_mutations={"lr": [0.1]},
    )


def test_pbt_neither_copies_into_nor_out_of_a_trial_at_its_final_report(monkeypatch):
    """A final report is no perturbation point: the finishing trial does not exploit (its copy would
    train nothing) and is no donor from then on; Tune's own PBT does both (what the test tells apart)."""
    from types import SimpleNamespace

    from ray.tune.experiment import Trial
    from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

    from raytrain_events.tune import pbt_scheduler

    def population(scheduler):
        acted = []
        monkeypatch.setattr(scheduler, "_checkpoint_or_exploit", lambda trial, _c, upper, lower: acted.append(
            (trial, list(upper), list(lower))))  # fmt: skip
        controller = SimpleNamespace(search_alg=None, get_trials=lambda: trials)
        trials = [Trial("__fake", stub=True) for _ in range(4)]
        for trial in trials:
            scheduler.on_trial_add(controller, trial)
        for loss, trial in zip((0.1, 0.2, 0.3, 0.4), trials):  # every trial at the first point, mid-run
            scheduler.on_trial_result(controller, trial, {"time/sample": 512, "loss": loss, "final": False})
        return controller, trials, acted

    ours = pbt_scheduler("512sp", lr=[0.1, 0.2], metric="loss", mode="min")
    controller, trials, acted = population(ours)
    assert len(acted) == 4 and acted[-1] == (trials[3], [trials[0]], [trials[3]])  # mid-run: the worst copies the best
    # The best trial ends; then the worst reaches its final report in the bottom quantile.
    assert ours.on_trial_result(controller, trials[0], {"time/sample": 1024, "loss": 0.05, "final": True}) == (
        TrialScheduler.CONTINUE
    )
    assert ours.on_trial_result(controller, trials[3], {"time/sample": 1024, "loss": 0.9, "final": True}) == (
        TrialScheduler.CONTINUE
    )
    assert len(acted) == 4  # neither final report perturbed anything
    ours.on_trial_result(controller, trials[2], {"time/sample": 1024, "loss": 0.8, "final": False})
    assert acted[-1] == (trials[2], [trials[1]], [trials[2]])  # ranked without the finished two: never a copy of 0

    tunes = tunes_own_pbt()
    controller, trials, acted = population(tunes)
    tunes.on_trial_result(controller, trials[0], {"time/sample": 1024, "loss": 0.05, "final": True})
    tunes.on_trial_result(controller, trials[3], {"time/sample": 1024, "loss": 0.9, "final": True})
    assert acted[-1] == (trials[3], [trials[0]], [trials[3]])  # Tune's: the finishing trial copies a finished donor
    assert type(pbt_scheduler("512sp", lr=[0.1, 0.2], synch=True)) is PopulationBasedTraining


def test_pbt_pauses_no_trial_for_room_while_the_sweep_runs_every_live_trial_at_once(monkeypatch):
    """Tune's asynchronous PBT pauses a trial at its perturbation point while another is pending or paused (a
    copied trial is paused to restart on its copy): time-multiplexing, whose pause ends the trial's Train run
    and restarts it from its own checkpoint. With room for every live trial (``trials_at_once``, set by `sweep`)
    the trial goes on; without it (or unset: Tune's behaviour) it is paused, as Tune's own PBT does."""
    from types import SimpleNamespace

    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler

    from raytrain_events.tune import pbt_scheduler

    def decision(scheduler, trials_at_once=None, finished=0):
        scheduler.trials_at_once = trials_at_once
        monkeypatch.setattr(scheduler, "_checkpoint_or_exploit", lambda *args: None)
        trials = [Trial("__fake", stub=True) for _ in range(3 + finished)]
        controller = SimpleNamespace(search_alg=None, get_trials=lambda: trials)
        for trial in trials:
            scheduler.on_trial_add(controller, trial)
            trial.set_status(Trial.RUNNING)
        trials[1].set_status(Trial.PAUSED)  # it copied a donor: paused, to restart on the copy
        for trial in trials[3:]:
            trial.set_status(Trial.TERMINATED)  # finished trials need no room
        return scheduler.on_trial_result(controller, trials[0], {"time/sample": 512, "loss": 0.1, "final": False})

    ours = lambda: pbt_scheduler("512sp", lr=[0.1, 0.2], metric="loss", mode="min")  # noqa: E731
    assert decision(ours(), trials_at_once=3) == TrialScheduler.CONTINUE
    assert decision(ours(), trials_at_once=3, finished=2) == TrialScheduler.CONTINUE
    assert decision(ours(), trials_at_once=2) == TrialScheduler.PAUSE  # a trial waits for room: time-multiplexed
    assert decision(ours()) == TrialScheduler.PAUSE
    tunes = tunes_own_pbt()
    assert decision(tunes, trials_at_once=3) == TrialScheduler.PAUSE  # what the test tells apart


def test_a_finished_trials_record_is_replayed_only_for_the_run_tune_restores(tmp_path):
    from raytrain_events.tune.trial import results_to_replay

    history = [
        {"time/batch": 4, "train/loss": 0.6},
        {"time/batch": 8, "train/loss": 0.4, "checkpoint_path": "x/trial_b/train/checkpoints/ckpt-8"},
        {"time/batch": 12, "train/loss": 0.3, "final": True},
    ]
    record = {"run_url": str(tmp_path / "trial_b" / "train"), "history": history}
    own = CheckpointPointer(
        url=str(tmp_path / "trial_b/train/checkpoints/ckpt-8"),
        counters={"epoch": 1, "batch": 8, "sample": 256, "token": 0},
        trial_folder="trial_b",
        run_name="train",
    )
    assert results_to_replay(None, own) is None  # nothing finished: train
    assert results_to_replay(record, None) == history  # Tune knows no checkpoint: every result
    assert results_to_replay(record, own) == history[2:]  # Tune has the results up to its checkpoint
    donor = CheckpointPointer(**{**own.__dict__, "trial_folder": "trial_a"})
    assert results_to_replay(record, donor) is None  # PBT copies trial_a into the finished trial: train
    copy_run = CheckpointPointer(**{**own.__dict__, "run_name": "from-trial_a-ckpt-8"})
    assert results_to_replay(record, copy_run) is None  # the copy's run restarts: the record is stale
