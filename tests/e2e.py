"""The end-to-end tier: which tests start a Ray run, and an audit that proves the list complete.

A test is **end to end** (marker ``e2e``) when it starts, itself or through a fixture:

* a Ray Train run: a ``TrainController`` (``RayTrainer.fit``, a Tune trial, a run through the CLI
  or the README's blocks on the session's Ray),
* a Ray instance of its own: an embedded Ray in a subprocess (an example run, a sweep killed and
  resumed), a ``ray.cluster_utils.Cluster``, ``ray start``,
* the cluster launcher (``ray up`` / ``ray submit`` / ``ray job submit`` / ``ray down``),
* a torchft ring of its own (a process per replica group and a Lighthouse: as long as a Ray run),
* a whole training run through a faulted object store (outages timed in seconds, then a resume), or
* an example script (``python examples/...``), or
* a torch world of 4 to 8 spawned gloo ranks that builds a multi-dimensional mesh and trains on it (the
  pipeline schedules, CP x TP, the reshard matrix, the GPU suite's CPU run): each 5-25 s of process start,
  rendezvous, mesh set-up and training on this machine, the inner loop's slowest tests. Their pure parts
  (splits, meshes, refusals) stay in the fast tier; or
* a spawn of 2-4 gloo ranks without a mesh whose work takes over ~4 s here (a compile on both ranks,
  sharded saves and loads counted byte by byte, some through the S3 server; a spawn shared by a
  module's tests): the fast tier's slowest after the meshes (4-7.6 s each at load ~8). Their pure
  parts and refusals stay in the fast tier.

The session's shared Ray (the ``ray_cluster`` fixture) does not count: tests that use it for Ray
Data, actors or tasks stay in the fast tier. ``pytest -m "not e2e"`` is the inner loop;
CONTRIBUTING.md gives both tiers' budgets.

``E2E`` below is the one list; ``tests/conftest.py`` marks its tests at collection, and a name in
it that no longer exists fails the collection of its module. The audit (``RTE_E2E_AUDIT=1``)
watches the pytest process's descendants while each test runs and fails a test that starts one
of the above without being listed; ``RTE_E2E_AUDIT=path.json`` also writes what each test started.
Run it over the fast tier (``RTE_E2E_AUDIT=1 python -m pytest -q -m "not e2e"``) after adding a
test that might start a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections import Counter
from typing import Dict, Optional, Set

import pytest

ALL = "*"

# module path (from the repository root) -> the test functions that are end to end, or ALL.
E2E: Dict[str, object] = {
    "tests/cluster/test_launcher.py": ALL,  # ray up / submit / job submit / down
    "tests/examples/test_console_report.py": ALL,  # the shared digits_run (embedded Ray)
    "tests/examples/test_hf_example.py": ALL,
    "tests/examples/test_mixture_example.py": ALL,  # one RayTrainer run in the session's Ray
    "tests/examples/test_resume_example.py": ALL,
    "tests/examples/test_train_example.py": ALL,
    "tests/checkpoint/test_object_store_faults.py": {  # 4 runs through a faulted S3 store, ~7 s each
        "test_training_survives_the_fault_and_resumes_exactly"
    },
    "tests/ray/fault_tolerance/test_chaos_soak.py": ALL,  # a 3-node Cluster
    "tests/ray/fault_tolerance/test_replica_abort.py": ALL,  # a torchft ring of 6 processes and a Lighthouse
    "tests/data/ray/test_data_network.py": ALL,  # a 3-node Cluster
    "tests/ray/test_loopback.py": ALL,  # an embedded Ray in a subprocess
    "tests/data/ray/test_mixture_run.py": ALL,  # one stop + resume pair of RayTrainer runs over a mixture
    "tests/data/ray/test_packed_run.py": ALL,  # one stop + resume pair of RayTrainer runs over packed sources
    "tests/data/ray/test_parquet_seek.py": {
        "test_ray_trainer_resumed_at_half_an_epoch_reads_nothing_before_its_position"
    },
    "tests/ray/guards/test_preemption_deadline.py": ALL,
    "tests/ray/test_ray_auto_microbatching.py": ALL,  # the module's auto_run
    "tests/ray/test_ray_fsdp.py": ALL,
    "tests/ray/test_ray_loggers_best.py": ALL,
    "tests/ray/test_ray_tensor_parallel.py": ALL,
    "tests/ray/test_ray_pipeline_parallel.py": {
        "test_a_pipeline_of_context_pairs_over_four_workers_trains_every_row_once_like_one_process"
    },
    "tests/ray/test_ray_trainer.py": ALL,
    "tests/ray/fault_tolerance/test_replica_groups.py": ALL,  # replica groups under torchft: a worker killed twice; the Lighthouse killed
    "tests/ray/fault_tolerance/test_sharded_replica_groups.py": ALL,  # 2 x 2 FSDP workers, 2 kills, eval + validation; resumed with TP
    "tests/ray/fault_tolerance/test_spike_replica_groups.py": ALL,  # 2 groups x 2 FSDP workers roll back together at a spike
    "tests/ray/test_resume.py": ALL,
    "tests/ray/test_spike_run.py": ALL,  # one stop + resume pair of RayTrainer runs with a planted spike
    "tests/ray/guards/test_watchdog.py": ALL,
    "tests/tune/test_tune_pbt.py": ALL,
    "tests/tune/test_tune_resume.py": ALL,
    "tests/tune/test_tune_mixture_example.py": ALL,  # examples/tune_mixture.py (local proxies, no Ray)
    # Tune trials: a sweep interrupted mid-round, then restored
    "tests/tune/test_mixture_searcher.py": {"test_tune_runs_the_rounds_the_searcher_places"},
    "tests/tune/test_tune_sweep.py": {
        "test_grid_over_three_algorithm_sets",
        "test_asha_on_global_samples_stops_the_bad_trial",
    },
    "tests/cli/test_cli.py": {"test_train_file_entry_point_on_ray_workers"},
    # torch worlds of 4-8 spawned gloo ranks on multi-dimensional meshes
    "tests/parallel/test_fsdp_training.py": {"test_hsdp_and_tensor_parallel_meshes_on_four_ranks_match_ddp"},
    "tests/parallel/test_deferred_init.py": {
        "test_deferred_on_four_ranks_of_a_2d_mesh_never_builds_the_model_whole_and_starts_like_eager"
    },
    "tests/parallel/test_reshard_matrix.py": ALL,  # FSDP x TP, FSDP 4, HSDP x TP, CP x TP hops on 4 ranks
    "tests/parallel/test_pipeline_parallel.py": {
        "test_each_schedule_trains_like_ddp_on_pp2_x_dp2",
        "test_pp2_x_cp2_trains_like_one_process",
        "test_pp2_x_fsdp2_x_tp2_and_pp2_x_cp2_x_dp2_on_eight_ranks_train_like_ddp",
        "test_pp2_checkpoint_resumes_on_pp4_and_on_one_process",
        "test_spike_guard_under_pp2_x_dp2_judges_the_whole_models_norm_and_rolls_back_with_every_rank",
        # refusals seen on every rank of that same PP 2 x DP 2 spawn (`hops_and_spike`, which trains first)
        "test_a_pipeline_whose_stages_load_different_batches_is_refused_on_every_rank",
        "test_a_packed_batch_for_a_model_without_pipeline_block_is_refused_on_every_rank",
        "test_a_sequence_the_context_split_cannot_cut_is_refused_on_every_rank_under_pp",
    },
    "tests/parallel/test_context_parallel.py": {"test_context_parallel_2_with_tensor_parallel_2_or_hsdp_matches_ddp"},
    "tests/parallel/test_document_attention.py": {
        "test_packed_training_under_cp_2_x_tp_2_matches_ddp",
        "test_packed_training_under_pp_2_x_dp_2_matches_ddp_for_each_schedule_and_keeps_documents_apart",
    },
    "tests/parallel/test_sharded_replica_state.py": {"test_fsdp_x_tp_shards_heal_by_position_at_a_real_shape"},
    "tests/parallel/test_gpu_suite.py": ALL,  # every part of bench/gpu_suite.py at tiny size on CPU ranks
    # spawns of 2-4 gloo ranks over ~4 s (at load ~8: 7.6, 7.4, 6.6, 6.1, 8.2 for two, 6.6 for a module's shared one)
    "tests/trainer/test_compile.py": {"test_compile_with_ddp_on_two_ranks"},  # inductor on both ranks
    "tests/parallel/test_sharded_load_cost.py": {
        "test_a_full_checkpoint_restart_gets_state_pt_from_rank_0_not_storage_on_another_node",
        "test_metadata_read_once_on_s3",
        "test_sharded_restart_reads_shards_from_the_local_tier_and_a_moved_rank_reads_storage",
        "test_reshard_reads_each_byte_about_once",  # a save and a load spawn each: 4.2 and 4.0 s
    },
    "tests/parallel/test_fsdp_auto_microbatching.py": {  # the module's one spawn (`runs`) and its three readers
        "test_an_oom_mid_forward_or_backward_on_one_rank_is_agreed_and_equals_starting_at_the_final_count",
        "test_an_oom_at_a_later_batch_equals_switching_there",
        "test_the_checks_cost_a_few_small_all_reduces_per_unit_and_microbatch",
    },
    "tests/test_readme.py": {"test_readme_python_blocks_run"},
}

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_of(item) -> str:
    return os.path.relpath(str(item.path), REPO)


def is_e2e(item) -> bool:
    names = E2E.get(_module_of(item))
    return names == ALL or (isinstance(names, set) and item.originalname in names)


def mark_items(items) -> None:
    """Mark the listed tests ``e2e``. That every listed name is a test of its module is checked by parsing the
    files (tests/test_e2e_tiers.py), not here: a run of one test by its node id collects only that test."""
    for item in items:
        if is_e2e(item):
            item.add_marker(pytest.mark.e2e)


# ----------------------------------------------------------------------------------- the audit
_RAY_CLI = re.compile(r"(^|/)ray$")
_RAY_CLI_STARTS = {"up", "submit", "exec", "job", "start", "down"}


def kind_of(cmdline: list) -> Optional[str]:
    """What a process started on our behalf is, from its command line; None for anything else."""
    if not cmdline or not cmdline[0].strip():
        return None
    head = cmdline[0]
    if head.startswith("ray::TrainController"):
        return "Ray Train run"
    if head.startswith("ray::ImplicitFunc") or head.startswith("ray::_Inner"):
        return "Ray Tune trial"
    if os.path.basename(head.split()[0]) == "gcs_server":
        return "Ray instance"
    for i, arg in enumerate(cmdline[:3]):
        if _RAY_CLI.search(arg) and i + 1 < len(cmdline) and cmdline[i + 1] in _RAY_CLI_STARTS:
            return f"ray {cmdline[i + 1]}"
    for arg in cmdline[1:3]:
        if arg.endswith(".py") and os.path.basename(os.path.dirname(arg)) == "examples":
            return None if "--help" in cmdline else "example run"  # printing its help is no run
    return None


class Audit:
    """Polls the descendants of this process and records, per running test, what they are."""

    def __init__(self, interval_s: float = 0.2) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._interval_s = interval_s
        self._baseline: Set[int] = set()
        self._seen: Set[int] = set()
        self._lock = threading.Lock()
        self.current: Optional[str] = None
        self.started: Dict[str, Set[str]] = {}
        # How many of each a test started (training workers too, which only a controller starts):
        # the CPU a test costs grows with these, about 7 CPU-s per worker and 35 per 2-worker fit.
        self.counts: Dict[str, Counter] = {}
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None  # what stopped the watching thread, if anything
        self._thread = threading.Thread(target=self._run, name="e2e-audit", daemon=True)

    def start(self) -> None:
        self._baseline = {p.pid for p in self._me.children(recursive=True)}
        self._thread.start()

    @contextlib.contextmanager
    def excluded(self):
        """What starts inside is no test's own (the session's shared Ray; the audit's own test)."""
        with self._lock:  # holds the watcher off until the new processes are in the baseline
            try:
                yield
            finally:  # a start that failed may leave processes behind: they are not a test's either
                self._baseline |= {p.pid for p in self._me.children(recursive=True)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def poll(self) -> None:
        with self._lock:
            for proc in self._me.children(recursive=True):
                if proc.pid in self._baseline or proc.pid in self._seen:
                    continue
                try:
                    cmdline = proc.cmdline()
                except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
                    continue
                kind = kind_of(cmdline)
                counted = kind or (
                    "training worker" if cmdline and cmdline[0].startswith("ray::RayTrainWorker") else None
                )
                if counted is None:
                    continue  # an idle worker may become a controller later: look again next time
                self._seen.add(proc.pid)
                if self.current is not None:
                    self.counts.setdefault(self.current, Counter())[counted] += 1
                    if kind is not None:
                        self.started.setdefault(self.current, set()).add(kind)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                self.poll()
        except BaseException as exc:  # the audit must not go blind silently: tests then fail on it
            self.error = exc

    def check_alive(self) -> None:
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the end-to-end audit stopped watching: {self.error!r}")


def audit_path() -> Optional[str]:
    value = os.environ.get("RTE_E2E_AUDIT", "")
    return value if value.endswith(".json") else None


def write_audit(audit: Audit, e2e_ids: Set[str]) -> None:
    path = audit_path()
    if path:
        with open(path, "w") as fh:
            data = {nodeid: dict(counts) for nodeid, counts in sorted(audit.counts.items())}
            json.dump({"started": data, "marked_e2e": sorted(e2e_ids)}, fh, indent=1)
