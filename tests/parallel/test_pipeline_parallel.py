"""Pipeline parallelism (``FSDPConfig(pipeline_parallel=p)``): each schedule trains like DDP on the
same global batches, with the events where the work is; PP x CP on 4 ranks; PP x FSDP x TP and
PP x CP x DP on 8 ranks; checkpoints across stage counts; bad input refused before any work, naming
the fix."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import pytest
import torch

from raytrain_events.parallel.config import FSDPConfig
from raytrain_events.parallel.pipeline_split import find_blocks, keep_stages, plan_stages
from tests.parallel.pp_workloads import SCHEDULES, ema_state, pp_config, pp_trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _merged(results: List[Dict[str, Any]], key: str = "model") -> Dict[str, torch.Tensor]:
    """The whole model from the ranks' stages (each rank returns its own stages' full parameters)."""
    merged: Dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result[key])
    return merged


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread for a Trainer in the test process, as the spawned ranks run: with the default
    threads a 4-batch run took 7-8 s on the loaded machine (spinning threads), 0.2 s with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ddp_reference() -> List[Dict[str, Any]]:
    """DDP on 2 ranks (one data shard each, 2 microbatches of grad accumulation), built eagerly."""
    from tests.parallel.pp_workloads import train_ddp
    from tests.parallel.spawn import run_ranks

    return run_ranks(2, train_ddp)


def _check_like_ddp(ddp: List[Dict[str, Any]], runs: List[Dict[str, Any]], atol: float, samples: int = 64) -> None:
    """The pipelined arm against DDP (or one process): whole model, loss on every rank of a pipeline,
    whole-model norm, the global Timestamp (``samples`` in 4 batches)."""
    assert _max_diff(_merged(runs), ddp[0]["model"]) <= atol
    assert _max_diff(_merged(runs, "ema"), ddp[0]["ema"]) <= atol  # EMA: each rank averages its stages
    initial = ddp[0]["model"]["blocks.0.mlp.fc.weight"]
    assert not torch.equal(_merged(runs)["blocks.0.mlp.fc.weight"], torch.zeros_like(initial))
    for run in runs:
        reference = ddp[run["shard"]]  # the DDP rank that loaded the same data shard
        assert run["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert run["norm"] == pytest.approx(reference["norm"], rel=1e-5)
        assert (run["samples"], run["batches"]) == (reference["samples"], reference["batches"]) == (samples, 4)
        # Evaluation (during fit at batch 4, and Trainer.eval after) and predict run the stages
        # forward only: the unsplit model's metrics on every rank, its outputs on every rank of a pipeline.
        assert len(run["evals"]) == len(reference["evals"]) == 2  # EVAL_END: 1 in fit, 1 in Trainer.eval (unlogged)
        for evaluated, expected in zip(run["evals"][:1] + [run["eval"]], reference["evals"][:1] + [reference["eval"]]):
            assert sorted(evaluated) == sorted(expected) and len(expected) == 2
            assert evaluated == pytest.approx(expected, abs=atol * 10)
        assert torch.allclose(run["predict"], reference["predict"], atol=atol * 10)


CP_SCHEDULES = ("interleaved1f1b",)  # under PP 2 x CP 2 on 4 ranks (`four_ranks`; 1F1B runs on 8 ranks)


@pytest.fixture(scope="module")
def four_ranks() -> List[List[Dict[str, Any]]]:
    """Every schedule under PP 2 x DP 2, 1F1B over HSDP and outermost, then `CP_SCHEDULES` under PP 2 x
    CP 2, on one spawn of 4 gloo ranks (a spawn and its imports cost seconds): each rank's results."""
    from tests.parallel.pp_workloads import train_schedules
    from tests.parallel.spawn import run_ranks

    hsdp = pp_config("1f1b", replicate=2)  # PP 2 x HSDP 2x1: the mesh (replicate, shard, pipeline)
    outermost = pp_config("1f1b", pipeline_outermost=True)  # the mesh (pipeline, shard): stages 2 ranks apart
    context = [pp_config(s, context_parallel=2) for s in CP_SCHEDULES]  # the mesh (shard 1, pipeline, context)
    return run_ranks(4, train_schedules, [pp_config(s) for s in SCHEDULES] + [hsdp, outermost] + context)


def test_each_schedule_trains_like_ddp_on_pp2_x_dp2(
    ddp_reference: List[Dict[str, Any]], four_ranks: List[List[Dict[str, Any]]]
) -> None:
    """PP 2 x DP 2 on 4 gloo ranks (a meta-built model, each rank materialising its stage only) trains
    the same 4 global batches to DDP's parameters for GPipe, 1F1B, Interleaved 1F1B and Looped BFS
    (2 stages per rank), 1F1B over HSDP, and 1F1B with the pipeline outermost (torchtitan's mesh order),
    with the model's loss on every rank, the whole model's clipping norm and an equal Timestamp; the
    loss events fire on the last stage only, BEFORE_FORWARD on the first."""
    results = four_ranks
    _check_like_ddp(ddp_reference, [results[rank][len(SCHEDULES)] for rank in range(4)], atol=1e-6)
    runs = [results[rank][len(SCHEDULES) + 1] for rank in range(4)]
    _check_like_ddp(ddp_reference, runs, atol=1e-6)
    assert [run["stages"] for run in runs] == [[0], [0], [1], [1]]  # a stage's FSDP group: consecutive ranks
    assert [run["shard"] for run in runs] == [0, 1, 0, 1]  # a pipeline's stages: ranks 0 and 2, 1 and 3
    assert runs[1]["events"]["BEFORE_FORWARD"] == 8 and runs[2]["events"]["AFTER_LOSS"] == 8
    full = sum(t.numel() for t in ddp_reference[0]["model"].values())
    for index, schedule in enumerate(SCHEDULES):
        runs = [results[rank][index] for rank in range(4)]
        assert [run["shard"] for run in runs] == [0, 0, 1, 1]
        _check_like_ddp(ddp_reference, runs, atol=1e-6)
        stages = [run["stages"] for run in runs]
        looped = schedule in ("interleaved1f1b", "loopedbfs")
        assert stages == ([[0, 2], [1, 3]] * 2 if looped else [[0], [1]] * 2), schedule
        for run in runs:  # a stage's layers, sharded over the 2 data-parallel ranks: under half the model
            assert run["local_numel"] < full / 2
        first, last = runs[0]["events"], runs[1]["events"]
        assert first == {"BEFORE_FORWARD": 8, "AFTER_BACKWARD": 4, "BATCH_END": 4}, schedule
        assert last == {
            "AFTER_FORWARD": 8,
            "BEFORE_LOSS": 8,
            "AFTER_LOSS": 8,
            "BEFORE_BACKWARD": 8,
            "AFTER_BACKWARD": 4,
            "BATCH_END": 4,
        }, schedule


def test_pp2_x_cp2_trains_like_one_process(four_ranks: List[List[Dict[str, Any]]]) -> None:
    """PP 2 x CP 2 on 4 gloo ranks, mesh (shard 1, pipeline, context), Interleaved 1F1B (2 stages per
    rank: each stage's forward routes its attention): each stage's context pair cuts every
    microbatch's sequence (load-balanced) and splits its attention, and the run trains the one data
    shard's batches to a one-process Trainer's parameters (2 microbatches of grad accumulation), with
    its loss on every rank, its clipping norm, its eval and predict, and an equal Timestamp (each
    sample counted once, not once per stage or context rank)."""
    from tests.parallel.pp_workloads import train_ddp

    with _one_thread():
        one = [train_ddp(0, 1)]  # one process on data shard 0, in this process
    for index, schedule in enumerate(CP_SCHEDULES, start=len(SCHEDULES) + 2):
        runs = [four_ranks[rank][index] for rank in range(4)]
        assert [run["shard"] for run in runs] == [0, 0, 0, 0], schedule  # one pipeline pair: the same rows
        assert [run["context"] for run in runs] == [(2, 0), (2, 1), (2, 0), (2, 1)], schedule
        looped = schedule == "interleaved1f1b"
        assert [run["stages"] for run in runs] == ([[0, 2]] * 2 + [[1, 3]] * 2 if looped else [[0]] * 2 + [[1]] * 2)
        _check_like_ddp(one, runs, atol=2e-5, samples=32)
        for run in runs[:2]:  # both context ranks of the first stage fire BEFORE_FORWARD per microbatch
            assert run["events"]["BEFORE_FORWARD"] == 8 and "AFTER_LOSS" not in run["events"]
        for run in runs[2:]:  # and both of the last stage the loss events, on their parts
            assert run["events"]["AFTER_LOSS"] == 8 and "BEFORE_FORWARD" not in run["events"]


def test_pp2_x_fsdp2_x_tp2_and_pp2_x_cp2_x_dp2_on_eight_ranks_train_like_ddp(
    ddp_reference: List[Dict[str, Any]],
) -> None:
    """On 8 gloo ranks, 1F1B: PP 2 x FSDP 2 x TP 2, mesh (shard, pipeline, tensor), and PP 2 x CP 2 x
    DP 2, mesh (shard, pipeline, context) with FSDP over shard x context: DDP's parameters within the
    float tolerance of the split reductions, the same losses and Timestamp."""
    from tests.parallel.pp_workloads import train_schedules
    from tests.parallel.spawn import run_ranks

    configs = [pp_config("1f1b", tensor_parallel=2), pp_config("1f1b", context_parallel=2)]
    results = run_ranks(8, train_schedules, configs)
    _check_like_ddp(ddp_reference, [result[0] for result in results], atol=2e-5)
    runs = [result[1] for result in results]
    assert [run["shard"] for run in runs] == [0] * 4 + [1] * 4
    assert [run["context"] for run in runs] == [(2, 0), (2, 1)] * 4
    _check_like_ddp(ddp_reference, runs, atol=2e-5)


@pytest.fixture(scope="module")
def hops_and_spike(tmp_path_factory: Any) -> Dict[str, Any]:
    """The checkpoint hops and the spike guard's runs, in one spawn of 4 ranks."""
    from tests.parallel.pp_workloads import pp_hops_and_spike
    from tests.parallel.spawn import run_ranks

    folder = str(tmp_path_factory.mktemp("pp") / "pp")
    return {"folder": folder, "ranks": run_ranks(4, pp_hops_and_spike, folder)}


def test_pp2_checkpoint_resumes_on_pp4_and_on_one_process(hops_and_spike: Dict[str, Any]) -> None:
    """A PP 2 x DP 2 checkpoint (DCP) resumes exactly on PP 4 (4 stages of one block, other layers'
    keys on other ranks), whose own save resumes exactly into a plain one-process Trainer; with the
    EMA's averages of each stage."""
    from tests.parallel.workloads import snapshot

    results = [r["hops"] for r in hops_and_spike["ranks"]]
    saved = [r["pp2_saved"] for r in results]
    loaded = [r["pp4_loaded"] for r in results]
    assert _max_diff(_merged(saved), _merged(loaded)) == 0.0
    assert _max_diff(_merged(saved, "optim"), _merged(loaded, "optim")) == 0.0
    assert _max_diff(_merged(saved, "ema"), _merged(loaded, "ema")) == 0.0  # each stage's averages, resharded
    assert _max_diff(_merged(saved, "ema"), _merged(saved)) > 0  # the averages are not the weights
    counts = [(e["timestamp"]["batch"], e["timestamp"]["sample"]) for e in saved + loaded]
    assert counts == [(2, 32)] * 8  # 2 batches of 2 pipelines x 8 rows, on every rank, saved and loaded
    pp4 = [r["pp4_saved"] for r in results]
    with _one_thread():
        trainer = pp_trainer(0, "ddp", "3ba", 1, hops_and_spike["folder"], meta=False, autoresume=True)
        one = {**snapshot(trainer), "ema": ema_state(trainer)}
        trainer.close()
    assert _max_diff(_merged(pp4), one["model"]) == 0.0
    assert _max_diff(_merged(pp4, "ema"), one["ema"]) == 0.0
    assert _max_diff(_merged(pp4, "optim"), one["optim"]) == 0.0
    assert one["timestamp"]["batch"] == 3 and one["timestamp"]["sample"] == 40  # + one batch of one pipeline


def test_spike_guard_under_pp2_x_dp2_judges_the_whole_models_norm_and_rolls_back_with_every_rank(
    hops_and_spike: Dict[str, Any],
) -> None:
    """SpikeGuard under PP 2 x DP 2: the gradient norm it judges is the whole model's (over the FSDP
    shards and both stages), equal to DDP's on the same global batches; a 50x loss planted in batch 4
    rolls every rank back at batch 5 (the agreement's) to the snapshot of batch 2, as under DDP, to the
    same model."""
    results = [r["spike"] for r in hops_and_spike["ranks"]]
    ddp = results[0]["ddp"]
    assert ddp["rollbacks"] == [{"batch": 5, "spike_batch": 4, "restored_batch": 2}]
    assert len(ddp["norms"]) == 4 and ddp["norms"][3] > 10 * ddp["norms"][2] > 0  # the 4th: the spike's
    for result in results:
        assert result["ddp"]["rollbacks"] == result["pp"]["rollbacks"] == ddp["rollbacks"]
        assert result["pp"]["norms"] == pytest.approx(ddp["norms"], rel=1e-5)
    assert _max_diff(_merged([r["pp"] for r in results]), ddp["model"]) <= 1e-6


def test_a_pipeline_whose_stages_load_different_batches_is_refused_on_every_rank(
    hops_and_spike: Dict[str, Any],
) -> None:
    """pipeline_outermost with the data sharded by rank // 2 (the consecutive rule): the first batch's
    check finds both pipelines' stages holding different batches and every rank raises, naming the fix."""
    messages = [r["mis-sharded"] for r in hops_and_spike["ranks"]]
    assert len(set(messages)) == 1
    assert "the ranks of pipelines [[0, 2], [1, 3]] got different batches" in messages[0]
    assert "trainer.parallel.data_parallel(rank, world_size)" in messages[0] and "ranks apart" in messages[0]


def test_a_packed_batch_for_a_model_without_pipeline_block_is_refused_on_every_rank(
    hops_and_spike: Dict[str, Any],
) -> None:
    """Packed rows (document_ids) under PP 2 x DP 2 for the model with its pipeline_block hook off (its
    stages would call block(hidden), and documents would attend to each other): every rank raises at
    the first batch, before the schedule, naming the hook to define."""
    messages = [r["packed-unmasked"] for r in hops_and_spike["ranks"]]
    assert len(set(messages)) == 1
    assert (
        "A packed batch (document_ids)" in messages[0] and "no pipeline_block(block, hidden, microbatch)" in messages[0]
    )
    assert "Fix: define pipeline_block" in messages[0]


def test_a_sequence_the_context_split_cannot_cut_is_refused_on_every_rank_under_pp(
    hops_and_spike: Dict[str, Any],
) -> None:
    """PP 2 x CP 2 on rows of 14 tokens (the load-balanced split needs a multiple of 2 x 2): every rank
    cuts the microbatches before the schedule and raises the same error, naming the fix, so no stage
    waits on another in a send."""
    messages = [r["uncuttable"] for r in hops_and_spike["ranks"]]
    assert len(set(messages)) == 1
    assert "context_parallel=2 cuts each sequence into 4 equal chunks" in messages[0]
    assert "the sequence has 14 positions. Fix: a sequence length divisible by 4" in messages[0]


# ----------------------------------------------------------------------------- bad input, no ranks


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pipeline_parallel": 4, "pipeline_microbatches": 2}, "fewer microbatches than its 4 pipeline stages"),
        (
            {"pipeline_parallel": 2, "pipeline_schedule": "interleaved1f1b", "pipeline_microbatches": 3},
            "Fix: a multiple of 2",
        ),
        (
            {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "pipeline_stages_per_rank": 2},
            "needs 1 \\(one stage per rank\\)",
        ),
        ({"pipeline_parallel": 2, "pipeline_schedule": "zb"}, "is not one of"),
        ({"pipeline_parallel": 2, "pipeline_split": [1, 2, 1]}, "must give 2 block counts"),
        ({"pipeline_parallel": 0}, "must be an integer >= 1"),
    ],
)
def test_bad_pipeline_options_are_refused(options: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FSDPConfig(**options)


def test_gpipe_takes_fewer_microbatches_and_defaults_fill_in() -> None:
    assert (
        FSDPConfig(pipeline_parallel=4, pipeline_schedule="gpipe", pipeline_microbatches=1).pipeline_microbatches == 1
    )
    config = FSDPConfig(pipeline_parallel=2, pipeline_schedule="interleaved1f1b")
    assert (config.pipeline_stages_per_rank, config.pipeline_microbatches) == (2, 2)


def test_mesh_product_must_equal_world_size() -> None:
    config = FSDPConfig(pipeline_parallel=2, tensor_parallel=2, replicate=2)
    assert config.mesh_dim_names() == ("replicate", "shard", "pipeline", "tensor")
    assert config.mesh_shape(16) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="divisible by 8, got 12 ranks"):
        config.mesh_shape(12)
    with pytest.raises(ValueError, match="pipeline_parallel=3.*divisible by 3"):
        FSDPConfig(pipeline_parallel=3, pipeline_schedule="gpipe").mesh_shape(4)


@pytest.mark.parametrize("degrees", [(2, 1, 1), (2, 2, 2), (4, 1, 2), (2, 2, 1)])
def test_an_outermost_pipeline_is_served_as_consecutive_ranks(degrees: Any) -> None:
    """`ParallelismSpec.serving_rank` (what RayTrainer's data path serves each rank as) is a permutation
    that puts every rank sharing rows (a pipeline's stages, world_size / p apart, with their context
    and tensor ranks) in one consecutive group of `batch_group`, the one `data_coordinates` names;
    without pipeline_outermost every rank is served as itself."""
    from raytrain_events.parallel.config import parse_parallelism

    pp, cp, tp = degrees
    options = {"pipeline_parallel": pp, "context_parallel": cp, "tensor_parallel": tp, "pipeline_schedule": "gpipe"}
    world = 2 * pp * cp * tp  # two pipelines
    for outermost in (True, False):
        spec = parse_parallelism({**options, "pipeline_outermost": outermost})
        served = [spec.serving_rank(rank, world) for rank in range(world)]
        assert sorted(served) == list(range(world))
        assert [s // spec.batch_group for s in served] == [spec.data_coordinates(r, world)[0] for r in range(world)]
        assert (served == list(range(world))) is not outermost


def test_stage_count_must_divide_the_blocks_or_a_split_be_given() -> None:
    with pytest.raises(ValueError, match="do not divide the model's 6 blocks evenly.*among \\[1, 2, 3, 6\\]"):
        plan_stages(6, 4, 1, None)
    with pytest.raises(ValueError, match="sums to 5 blocks, but the model has 6"):
        plan_stages(6, 2, 1, [2, 3])
    layout = plan_stages(6, 2, 2, [1, 2, 2, 1])
    assert layout.ranges == ((0, 1), (1, 3), (3, 5), (5, 6))
    assert layout.stages_of(0) == [0, 2] and layout.stages_of(1) == [1, 3]


def test_a_stage_keeps_only_its_layers_under_their_names() -> None:
    from examples.transformer_lm import TransformerLM

    with torch.device("meta"):
        model = TransformerLM(depth=4)
    held, _ = keep_stages(model, plan_stages(4, 2, 1, None), 1)
    assert sorted(held) == [1]
    names = {n.split(".")[0] + "." + n.split(".")[1] for n in dict(model.named_parameters()) if n.startswith("blocks")}
    assert names == {"blocks.2", "blocks.3"}
    assert model.tokens is None and model.head is not None


def test_a_model_without_the_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="pipeline_embed, pipeline_head missing"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grad_accum": 2}, "grad_accum=2 with FSDPConfig\\(pipeline_parallel=2\\).*Fix: grad_accum=1"),
        (
            {"grad_accum": "auto"},
            "grad_accum='auto'.*cannot apply.*already splits each batch into pipeline_microbatches=2.*blocked in "
            "point-to-point receives.*Fix: grad_accum=1 and a fixed FSDPConfig\\(pipeline_microbatches=n\\)",
        ),
        ({"precision": "amp_fp16"}, "amp_fp16.*Fix: precision='amp_bf16'"),
        ({"compile": True}, "compile=True with FSDPConfig.*the stages never call"),
    ],
)
def test_loop_options_that_do_not_compose_are_refused(kwargs: Dict[str, Any], message: str) -> None:
    from raytrain_events.trainer.options import LoopOptions

    with pytest.raises(ValueError, match=message):
        LoopOptions(parallelism=pp_config("1f1b"), **kwargs)


def test_algorithms_that_cannot_run_under_pp_are_refused_before_any_work() -> None:
    from examples.transformer_lm import TransformerLM, random_tokens
    from raytrain_events import Trainer
    from raytrain_events.algorithms.layer_freezing import LayerFreezing
    from raytrain_events.algorithms.mixup import MixUp
    from raytrain_events.algorithms.sam import SAM

    with torch.device("meta"):
        model = TransformerLM(depth=4)
    with pytest.raises(
        ValueError, match="MixUp: it mixes the inputs on the first stage(.|\n)*LayerFreezing(.|\n)*SAM: its ascent"
    ):
        Trainer(
            model=model,
            train_dataloader=torch.utils.data.DataLoader(random_tokens(8), batch_size=4),
            max_duration="1ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            parallelism=pp_config("1f1b"),
            algorithms=[MixUp(), LayerFreezing(), SAM()],
        )
