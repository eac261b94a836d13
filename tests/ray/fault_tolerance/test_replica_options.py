"""``fault_tolerance="replica_groups"``: what it refuses, on the driver, before Ray starts (no Ray here)."""

from __future__ import annotations

import importlib.util

import pytest

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.ray.driver import RayTrainer
from raytrain_events.ray.replica_checks import lighthouse_bind
from raytrain_events.ray.spec import RunSpec


def _options(**over):
    base = dict(
        model=lambda: None,
        optimizers=lambda m: None,
        datasets={"train": object()},
        max_duration="1ep",
        num_workers=3,
        fault_tolerance="replica_groups",
    )
    base.update(over)
    return base


def test_replica_groups_are_a_run_option():
    spec = RunSpec(**_options())
    assert spec.failures.fault_tolerance == "replica_groups"
    assert spec.for_workers().failures.fault_tolerance == "replica_groups"  # the workers build their groups from it
    assert spec.describe()["fault_tolerance"] == "replica_groups"


@pytest.mark.parametrize(
    "over, named",
    [
        (dict(fault_tolerance="groups"), "fault_tolerance='groups'"),
        (dict(num_workers=1), "num_workers >= 2"),
        (dict(num_workers=(2, 4)), "elastic"),
        (dict(parallelism="fsdp"), "parallelism other than 'ddp'"),
        (dict(checkpoint=CheckpointConfig(keep_best=2, metric="metrics/eval/loss", mode="min")), "keep_best"),
        (dict(get_num_tokens_in_batch=len), "get_num_tokens_in_batch"),
        (
            dict(
                datasets={"a": object(), "b": object()},
                mixture={"sources": {"a": 10, "b": 10}, "stages": {"0dur": {"a": 0.5, "b": 0.5}}},
            ),
            "mixture=",
        ),
        (dict(precision="amp_fp16"), "fp16"),
    ],
)
def test_unsupported_combinations_are_refused_with_the_fix(over, named):
    with pytest.raises(ValueError, match="fault_tolerance") as error:
        RayTrainer(**_options(**over))
    assert named in str(error.value)
    assert "Fix:" in str(error.value)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), "30", True])
def test_a_bad_replica_timeout_is_refused(timeout):
    with pytest.raises(ValueError, match=r"replica_timeout_s=.* must be a number of seconds > 0"):
        RayTrainer(**_options(replica_timeout_s=timeout))
    assert RunSpec(**_options(replica_timeout_s=12.5)).for_workers().failures.replica_timeout_s == 12.5


def test_the_default_single_worker_is_refused_on_the_driver():
    options = _options()
    del options["num_workers"]
    with pytest.raises(ValueError, match="need num_workers >= 2"):
        RayTrainer(**options)


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'raytrain_events\[ft\]'"):
        RayTrainer(**_options())


def test_the_lighthouse_binds_loopback_when_ray_does():
    assert lighthouse_bind("127.0.0.1") == "127.0.0.1:0"
    assert lighthouse_bind("10.0.3.7") == "[::]:0"


def test_the_lighthouse_drops_a_dead_group_fast_and_waits_for_a_late_one():
    """A group that stops heartbeating stops holding back the quorum after 0.5 s; one that still heartbeats
    but is late to the quorum (the lead's checkpoint copy, a loaded machine) is waited for up to
    ``replica_timeout_s``, below the quorum's own limit (twice that)."""
    from raytrain_events.ray.replica_checks import lighthouse_options

    assert lighthouse_options(3, 30.0) == {"min_replicas": 2, "heartbeat_timeout_ms": 500, "join_timeout_ms": 30000}
    assert lighthouse_options(8, 2.5)["join_timeout_ms"] == 2500


def test_periodic_checkpoints_are_accepted_and_one_group_saves():
    """``checkpoint=`` with replica groups: accepted on the driver; the workers' config keeps ``keep`` (nothing
    is reported to Ray, so the saver prunes), the run dir's lock is group 0's, and SIGTERM is a failure."""
    from raytrain_events.ray.fault_tolerance.replica_groups import checkpoint_config

    trainer = RayTrainer(**_options(checkpoint=CheckpointConfig(save_interval="5ba", keep=2)))
    plan = trainer.plan.checkpoint  # the run plan's, made once on the driver
    assert plan is not None
    lead, other = (checkpoint_config(plan.worker, trainer.spec.checkpoints.checkpoint, g) for g in (0, 2))
    assert lead.keep == other.keep == 2 and lead.save_folder == plan.worker.save_folder
    # Nothing is read while the Trainer is built: the run's autoresume waits for the first quorum (load_at_first_quorum).
    assert plan.worker.autoresume and not lead.autoresume and lead.load_from is None
    assert lead.lock_run_dir == plan.worker.lock_run_dir and not other.lock_run_dir
    assert not lead.save_on_sigterm and not other.save_on_sigterm


def test_eval_sets_are_accepted_and_every_group_evaluates_the_whole_set():
    """An in-loop eval set with replica groups: accepted on the driver, and each group's worker side carries an
    iterator over the whole set (made on the driver, the same for a replaced group), not Ray Train's per-worker
    split (a replaced group would get a world of one's). No Ray here: the datasets are stand-ins."""
    from raytrain_events.ray.fault_tolerance import choose

    class Set:
        def __init__(self, name):
            self.name = name

        def iterator(self):
            return ("whole", self.name)

    class Data:
        def configure(self, datasets, world, handles, nodes):
            assert set(datasets) == {"train"}, datasets  # only the train set is cut (by the step's quorum)
            return [{"train": ("train", rank)} for rank in range(world)]

    async_val = dict(validation={"datasets": ["test"]}, checkpoint=CheckpointConfig(save_interval="5ba"))
    RayTrainer(**_options(datasets={"train": object(), "val": object(), "test": object()}, **async_val))  # accepted
    trainer = RayTrainer(**_options(datasets={"train": object(), "val": object(), "test": object()}))
    sets = {"train": Set("train"), "val": Set("val"), "test": lambda: Set("test")}  # Ray Train's zero-argument form
    side, ray_datasets = choose(trainer.spec, trainer.plan).worker_side(Data(), sets, None)
    assert ray_datasets == {}  # Ray Train shards nothing
    assert side.shards == [("train", 0), ("train", 1), ("train", 2)]
    assert side.evals == {"val": ("whole", "val"), "test": ("whole", "test")}


def test_a_lost_lighthouse_is_told_apart_and_ends_the_run_on_the_controller(monkeypatch):
    """The worker's check (a TCP connect to ``TORCHFT_LIGHTHOUSE``) and the controller callback that turns a
    worker's `LighthouseLostError` into the run's end (no Ray run here; the Ray run is in test_replica_groups)."""
    import socket

    from raytrain_events.ray.replica_lighthouse import (
        LIGHTHOUSE_ENV,
        LighthouseLostError,
        LighthouseWatch,
        lighthouse_lost,
        lighthouse_reachable,
    )

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    assert lighthouse_reachable(f"http://127.0.0.1:{port}")
    monkeypatch.setenv(LIGHTHOUSE_ENV, f"http://127.0.0.1:{port}")
    assert lighthouse_lost(TimeoutError("quorum")) is None  # alive: the quorum's own error stands
    listening.close()
    assert not lighthouse_reachable(f"http://127.0.0.1:{port}", wait_s=0.01)
    monkeypatch.setattr("raytrain_events.ray.replica_lighthouse.lighthouse_reachable", lambda address: False)
    lost = lighthouse_lost(TimeoutError("quorum"))
    assert isinstance(lost, LighthouseLostError) and f"127.0.0.1:{port} is gone" in str(lost) and "Fix:" in str(lost)
    watch = LighthouseWatch()
    watch.after_exception(None, {0: RuntimeError("gloo: connection reset")})  # any other failure: Ray retries
    worker_error = RuntimeError(f"Traceback ...\nraytrain_events.ray.replica_lighthouse.LighthouseLostError: {lost}")
    with pytest.raises(LighthouseLostError, match="Fix: run again with the same run_name"):
        watch.after_exception(None, {0: RuntimeError("reset"), 1: worker_error})
    with pytest.raises(LighthouseLostError, match="is gone"):  # as Ray hands it over: the exception itself
        watch.after_exception(None, {1: lost})


def test_a_spike_guard_runs_in_groups_of_one_and_of_several_workers_and_its_bisection_is_refused(monkeypatch):
    """Replica groups vote on a spike with each step's gradient all-reduce (callbacks/spike_groups.py; a group of
    several workers on values summed over the group first), so a plain SpikeGuard is accepted in groups of one worker
    and of several; its bisection and quarantine (collectives of one world) are refused on the driver (instances)
    before Ray starts, naming why and the fix, and at each group's INIT for what a callbacks(config) factory built."""
    from types import SimpleNamespace

    import ray

    from raytrain_events.callbacks import SpikeGuard
    from raytrain_events.core.state import State
    from raytrain_events.ray.replica_groups import ReplicaCommit

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(ray, "init", no_ray)
    RayTrainer(**_options(callbacks=[SpikeGuard()]))  # accepted
    RayTrainer(**_options(callbacks=[SpikeGuard()], num_workers=4, replica_group_size=2, parallelism="fsdp"))
    for groups in ({}, dict(num_workers=4, replica_group_size=2, parallelism="fsdp")):
        with pytest.raises(ValueError, match=r"SpikeGuard\(bisect=True\) or a quarantine") as error:
            RayTrainer(**_options(callbacks=[SpikeGuard(bisect=True, row_key="id")], **groups))
        assert "torchft may drop or add a group" in str(error.value) and "use SpikeGuard() without them" in str(
            error.value
        )
    RunSpec(**_options(callbacks=lambda config: [SpikeGuard(row_key="id")]))  # a factory: known only on the workers
    commit = SimpleNamespace(loader=SimpleNamespace(group_size=3))
    with pytest.raises(ValueError, match="or a quarantine"):
        ReplicaCommit.init(commit, State(model=None, callbacks=[SpikeGuard(row_key="id")]), None)
    commit.loader.replicas = SimpleNamespace(state=None)
    ReplicaCommit.init(commit, State(model=None, callbacks=[SpikeGuard()]), None)  # accepted in a group of 3


def test_a_joining_group_receives_the_runs_skip_list_and_skipped_counts_from_its_peer():
    """The live recovery's state (`ReplicaState`) carries a SpikeGuard's skip list and rollbacks and `State.skipped`:
    a group replaced after a rollback then saves and reports what the others do."""
    import torch

    from raytrain_events.callbacks import SpikeGuard
    from raytrain_events.core.spikes import SkipRange
    from raytrain_events.core.state import State
    from raytrain_events.ray.replica_groups import ReplicaState

    def replica():
        model = torch.nn.Linear(2, 2)
        replicas = ReplicaState()
        replicas.model, replicas.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1)
        replicas.state = State(model=model, callbacks=[SpikeGuard()])
        return replicas

    live, joining = replica(), replica()
    guard = live.state.callbacks[0]
    guard.skips.add(SkipRange(0, 132, 156, 2, 0))
    guard.rollbacks.append({"batch": 13, "restored_batch": 11})
    live.state.skipped.add_window(2, 24, 0)
    joining.load_state_dict(live.state_dict())
    assert joining.state.callbacks[0].skips.ranges == [SkipRange(0, 132, 156, 2, 0)]
    assert joining.state.callbacks[0].rollbacks == [{"batch": 13, "restored_batch": 11}]
    assert joining.state.skipped.state_dict() == live.state.skipped.state_dict()
    assert "skipped" not in ReplicaState.state_dict(_without_guard(live))  # no guard: what it sent before


def _without_guard(replicas):
    replicas.state.callbacks = []
    return replicas
