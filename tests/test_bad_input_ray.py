"""Mistakes users make with `RayTrainer`, round three (issue 48): each refused before Ray starts, naming the fix.

Every case goes through ``RayTrainer(...).fit()`` with Ray's start patched to fail (`no_ray`), and
no run directory may appear. The options' own checks live in ``ray/spec_checks.py`` (values and
combinations), the data's in ``ray/data_checks.py`` and the user code's in ``ray/driver_checks.py``.
The cases are variations of the issue's probes: silent wrong training, refusals that used to come
only after Ray started, and crashes without a hint.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from bad_input_helpers import no_ray, parquet_source, ray_kwargs  # noqa: F401 (no_ray: a fixture)

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.parallel.config import FSDPConfig


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("bad-input-ray")
    return {
        "web": parquet_source(str(folder / "web.parquet"), 40),
        "code": parquet_source(str(folder / "code.parquet"), 30),
    }


def _mixture(stages: Dict[str, Any], **over: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    return lambda s: dict(datasets=dict(s), mixture={"sources": {"web": 40, "code": 30}, "stages": stages}, **over)


def _plain(**over: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    return lambda s: over


def _train(**over: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    return lambda s: dict(datasets={"train": s["web"]}, **over)


# (id, the changed arguments (a function of the Parquet sources), error type, pattern naming the problem and fix)
CASES: List[Tuple[str, Callable[[Dict[str, Any]], Dict[str, Any]], type, str]] = [
    # -- silent, wrong training: now refused
    ("global-batch-true", _plain(global_batch_size=True), ValueError, r"global_batch_size=True must be a positive"),
    ("global-batch-false", _plain(global_batch_size=False), ValueError, r"global_batch_size=False"),
    ("shuffle-negative", _plain(shuffle_buffer_size=-1), ValueError, r"shuffle_buffer_size=-1 .*>= 1"),
    ("shuffle-without-seed", _plain(shuffle_buffer_size=64, seed=None), ValueError, r"seed=None.*not be shuffled"),
    ("steps-fewer-than-rows", _train(steps_per_epoch=7, batch_size=4), ValueError, r"40 rows make 10 global batches"),
    ("steps-more-than-rows", _train(steps_per_epoch=20, batch_size=8), ValueError, r"40 rows make 5 .*unset"),
    ("report-every-negative", _plain(report_every_s=-5), ValueError, r"report_every_s=-5 .*barrier"),
    ("report-every-zero", _plain(report_every_s=0), ValueError, r"report_every_s=0 must be a positive"),
    ("report-every-inf", _plain(report_every_s=float("inf")), ValueError, r"report_every_s=inf"),
    # -- refused only after Ray started, now before
    (
        "stage-after-the-run",
        _mixture({"0dur": {"web": 1}, "5ep": {"code": 1}}, max_duration="2ep"),
        ValueError,
        r"Stage '5ep' .*after the run's end.*lengthen max_duration",
    ),
    (
        "stage-samples-after-the-run",
        _mixture({"0dur": {"web": 1}, "500sp": {"code": 1}}),
        ValueError,
        r"Stage '500sp' .*after the run's end",
    ),
    (
        "stages-out-of-order",
        _mixture({"0dur": {"web": 1}, "0.6dur": {"code": 1}, "0.3dur": {"web": 1}}),
        ValueError,
        r"order the stages",
    ),
    (
        "dur-stage-in-a-token-run",
        _mixture(
            {"0dur": {"web": 1}, "0.5dur": {"code": 1}}, max_duration="900tok", get_num_tokens_in_batch=lambda b: 1
        ),
        ValueError,
        r"'0.5dur' .*max_duration in 'ep', 'sp' or 'ba'",
    ),
    ("report-interval-0ba", _plain(report_interval="0ba"), ValueError, r"report_interval='0ba' must be a positive"),
    ("report-interval-0ep", _plain(report_interval="0ep"), ValueError, r"report_interval='0ep'"),
    ("report-interval-past-the-run", _plain(report_interval="1.5dur"), ValueError, r"at most '1dur'"),
    (
        "hsdp-replicas-do-not-divide",
        _plain(parallelism=FSDPConfig(replicate=3), num_workers=4),
        ValueError,
        r"replicate=3.*divisible by 3, got 4",
    ),
    (
        "hsdp-x-tp-do-not-divide",
        _plain(parallelism=FSDPConfig(replicate=2, tensor_parallel=2), num_workers=6),
        ValueError,
        r"divisible by 4, got 6",
    ),
    (
        "tp-without-a-plan",
        _plain(parallelism=FSDPConfig(tensor_parallel=2), num_workers=4),
        ValueError,
        r"no submodule of ClassifierModel has a tensor_parallel_plan",
    ),
    (
        "cp-without-a-split",
        _plain(parallelism=FSDPConfig(context_parallel=2), num_workers=4),
        ValueError,
        r"ClassifierModel has no context_parallel_split",
    ),
    ("storage-in-memory", _plain(storage_path="memory://runs"), ValueError, r"memory:// .*separate processes"),
    (
        "run-name-too-long",
        _plain(run_name="r" * 256),
        ValueError,
        r"is 256 bytes long: a folder name holds at most 255",
    ),
    ("run-name-too-long-in-bytes", _plain(run_name="é" * 130), ValueError, r"260 bytes long"),
    ("use-gpu-a-string", _plain(use_gpu="false"), TypeError, r"use_gpu='false' must be True or False.*use_gpu=False"),
    ("use-gpu-yes", _plain(use_gpu="yes"), TypeError, r"use_gpu=True"),
    ("resources-lower-case", _plain(resources_per_worker={"cpu": 1}), ValueError, r"\['cpu'\].*\{'CPU': 1\}"),
    ("resources-mixed-case", _plain(resources_per_worker={"Cpu": 2, "gpu": 1}), ValueError, r"\{'CPU': 2, 'GPU': 1\}"),
    ("column-typo", _train(columns=["idd"]), ValueError, r"\['idd'\].*did you mean 'id'.*\['id', 'x'\]"),
    (
        "mixture-column-typo",
        _mixture({"0dur": {"web": 1, "code": 1}}, columns=["x", "y"]),
        ValueError,
        r"names \['y'\], which datasets\['(code|web)'\] does not have",
    ),
    (
        "load-from-missing",
        _plain(checkpoint=CheckpointConfig(load_from="/no/such/run/checkpoints")),
        FileNotFoundError,
        r"load_from='/no/such/run/checkpoints'\): nothing is there",
    ),
    # -- crashes without a hint
    (
        "global-batch-below-workers",
        _plain(global_batch_size=3, num_workers=4),
        ValueError,
        r"global_batch_size=3 is smaller than the 4 data-parallel workers",
    ),
    (
        "global-batch-below-elastic-max",
        _plain(global_batch_size=4, num_workers=(2, 8)),
        ValueError,
        r"smaller than the 8 data-parallel",
    ),
    ("shuffle-a-string", _plain(shuffle_buffer_size="1000"), TypeError, r"shuffle_buffer_size=1000 \(rows\)"),
    ("max-failures-a-string", _plain(max_failures="3"), TypeError, r"max_failures='3' .*max_failures=3"),
    ("max-failures-a-float", _plain(max_failures=2.5), TypeError, r"max_failures=2.5 must be an integer"),
    ("steps-per-epoch-zero", _plain(steps_per_epoch=0), ValueError, r"steps_per_epoch=0 must be a positive"),
]


@pytest.mark.parametrize("changes, error, fix", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_ray_trainer_refuses_before_ray_starts(tmp_path, no_ray, sources, changes, error, fix):  # noqa: F811
    from raytrain_events.ray.driver import RayTrainer

    storage = tmp_path / "store"
    with pytest.raises(error, match=fix):
        RayTrainer(**ray_kwargs(**{"storage_path": str(storage), **changes(sources)})).fit()
    assert not storage.exists()  # no run directory was made


def test_a_storage_path_inside_a_file_is_refused(tmp_path, no_ray):  # noqa: F811
    from raytrain_events.ray.driver import RayTrainer

    file = tmp_path / "notes.txt"
    file.write_text("x")
    for inside in (file / "runs", file / "a" / "b"):
        with pytest.raises(NotADirectoryError, match=r"notes.txt', which is a file, not a folder"):
            RayTrainer(**ray_kwargs(storage_path=str(inside))).fit()


def test_numpy_mixture_weights_and_counts_are_accepted(tmp_path, no_ray, sources):  # noqa: F811
    """numpy numbers as weights (what a Dirichlet sample or a grid gives) are read as the numbers they print as."""
    from raytrain_events.ray.driver import RayTrainer

    mixture = {
        "sources": {"web": np.int64(40), "code": 30},
        "stages": {"0dur": {"web": np.float32(0.7), "code": np.float64(0.3)}, "1ep": {"web": np.int64(1)}},
    }
    spec = RayTrainer(
        **ray_kwargs(storage_path=str(tmp_path), datasets=dict(sources), mixture=mixture, max_duration="2ep")
    ).spec
    assert spec.data.mixture["stages"]["0dur"] == {"web": 0.7, "code": 0.3}
    assert type(spec.data.mixture["stages"]["0dur"]["web"]) is float and spec.data.mixture["sources"]["web"] == {
        "rows": 40
    }


def test_an_optimizer_factory_default_is_not_given_the_config(tmp_path, no_ray):  # noqa: F811
    """``lambda model, lr=0.1: ...`` used to receive the config dict as ``lr``; a parameter named config still does."""
    from raytrain_events.ray.driver import RayTrainer

    seen: Dict[str, Any] = {}

    def optimizers(model: torch.nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr)

    def schedulers(optimizer: Any, step_size: int = 2, config: Any = None) -> Any:
        seen["config"] = config
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size)

    spec = RayTrainer(
        **ray_kwargs(storage_path=str(tmp_path), optimizers=optimizers, schedulers=schedulers, config={"lr": 0.5})
    ).spec
    built = spec.build_optimizers(spec.build_model())
    assert built.param_groups[0]["lr"] == 0.1
    assert spec.build_schedulers(built).step_size == 2 and seen["config"] == {"lr": 0.5}


def test_the_refusals_need_no_ray_and_no_files(tmp_path, no_ray, sources):  # noqa: F811
    """The same checks pass for a good run: they refuse the mistake, not the run (Ray's start still follows)."""
    from raytrain_events.ray.driver import RayTrainer

    good = RayTrainer(
        **ray_kwargs(
            storage_path=str(tmp_path / "store"),
            datasets={"train": sources["web"]},
            columns=["x"],
            steps_per_epoch=5,
            batch_size=8,
            shuffle_buffer_size=16,
            resources_per_worker={"CPU": 1},
            report_interval="0.5dur",
        )
    )
    with pytest.raises(AssertionError, match="Ray was started"):  # every check passed: fit went on to start Ray
        good.fit()
    assert not os.path.exists(tmp_path / "store")


def test_the_workers_copy_of_a_good_parallel_run_passes_the_same_checks(tmp_path, no_ray):  # noqa: F811
    """`RunSpec.for_workers` drops the driver-only worker count: the mesh rule must not then refuse a good run."""
    from raytrain_events.ray.driver import RayTrainer

    spec = RayTrainer(
        **ray_kwargs(storage_path=str(tmp_path), parallelism=FSDPConfig(replicate=2, tensor_parallel=2), num_workers=4)
    ).spec
    assert spec.for_workers().parallelism_spec.fsdp.replicate == 2
