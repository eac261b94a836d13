"""Pipeline parallelism: each schedule's bubble against the theory, and steps/s against FSDP alone.

**Bubble** (``--part bubble``): ``p`` gloo ranks (CPU) train through `Trainer` with
``FSDPConfig(pipeline_parallel=p, pipeline_schedule=s, pipeline_microbatches=m)`` a model of 8
blocks whose forward sleeps ``F`` ms and backward ``2F`` ms per block and microbatch (a sleep holds
no core, so the ranks' contention for the machine's cores does not blur the schedule: what is
measured is the schedule's idle time, not the compute's). A rank's useful time per step is
``m x (its blocks) x 3F``; the bubble measured is ``1 - useful / step time`` (the median of the
steps after the first 2, rank 0's BATCH_START to BATCH_END, which includes the per-batch sum and
the optimizer step: a few ms). Theory (Narayanan et al. 2021): ``(p - 1) / (m + p - 1)`` for GPipe
and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved over ``v`` stages per rank.

**Steps/s** (``--part speed``): the example transformer on 4 ranks, the same global batch (32 rows),
PP 2 x FSDP 2 (1F1B, 4 microbatches) against FSDP 4 alone, and PP 2 x FSDP 2 with the model's
``pipeline_block`` hook off (the stages send the hidden state only, not the microbatch's index that
packed batches' document masks need: that index's cost); arms alternate for ``--repeats``
rounds, a fresh `Trainer` each; printed: the median step and its spread, and the ratio.

**Evaluation** (``--part eval``): the same model and arms, ``Trainer.eval`` of the same global rows
(8 batches: 2 pipelines x 16 rows or 4 ranks x 8), forward only: under PP the stages run the
pipeline's 4 microbatches through ``pipeline_eval.forward_only`` (activations sent point to point),
against FSDP 4's whole-model forward (the alternative: evaluating a checkpoint without PP). Per
round one warm-up ``eval`` then the median of 3, arms alternating for ``--repeats`` rounds; printed:
the median and spread of an eval pass, rows/s and the ratio.

Usage::

    python bench/pipeline_bench.py                 # both parts
    python bench/pipeline_bench.py --part bubble --sleep-ms 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

BLOCKS = 8


def _sleep_model(sleep_s: float) -> Any:
    import torch

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            time.sleep(sleep_s)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            time.sleep(2 * sleep_s)
            return grad

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return Sleep.apply(self.scale(x))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(4, 4)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
            self.out = torch.nn.Linear(4, 1)

        def pipeline_embed(self, batch: Any) -> Any:
            return self.inp(batch[0])

        def pipeline_head(self, x: Any) -> Any:
            return self.out(x)

        def forward(self, batch: Any) -> Any:
            x = self.pipeline_embed(batch)
            for block in self.blocks:
                x = block(x)
            return self.pipeline_head(x)

        def loss(self, outputs: Any, batch: Any) -> Any:
            return torch.nn.functional.mse_loss(outputs, batch[1])

    return Net()


def _bubble_rank(rank: int, world_size: int, configs: List[Dict[str, Any]], sleep_s: float) -> List[float]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from raytrain_events import Trainer
    from tests.parallel.ac_workloads import StepTimes

    out = []
    for config in configs:
        timer = StepTimes()
        torch.manual_seed(0)
        model = _sleep_model(sleep_s)
        rows = 2 * config["pipeline_microbatches"]
        data = TensorDataset(torch.randn(6 * rows, 4), torch.randn(6 * rows, 1))
        trainer = Trainer(
            model=model,
            train_dataloader=DataLoader(data, batch_size=rows),
            max_duration="6ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
            parallelism=config,
            callbacks=[timer],
        )
        trainer.fit()
        trainer.close()
        out.append(statistics.median(timer.times[2:]))
    return out


def bubble(sleep_ms: float) -> None:
    from tests.parallel.spawn import run_ranks

    sleep_s = sleep_ms / 1000
    print(f"Bubble: {BLOCKS} blocks, forward {sleep_ms:g} ms + backward {2 * sleep_ms:g} ms per block and microbatch")
    print(f"{'p':>2} {'schedule':<16} {'v':>2} {'m':>3} {'step s':>8} {'measured':>9} {'theory':>7} {'ratio':>6}")
    for p in (2, 4):
        configs = []
        for schedule in ("gpipe", "1f1b", "interleaved1f1b"):
            for m in (p, 2 * p, 4 * p):
                configs.append({"pipeline_parallel": p, "pipeline_schedule": schedule, "pipeline_microbatches": m})
        times = run_ranks(p, _bubble_rank, configs, sleep_s, timeout=1800)[0]
        for config, step in zip(configs, times):
            m, schedule = config["pipeline_microbatches"], config["pipeline_schedule"]
            v = 2 if schedule == "interleaved1f1b" else 1
            useful = m * (BLOCKS // p) * 3 * sleep_s
            measured = 1 - useful / step
            theory = (p - 1) / (v * m + p - 1)
            print(
                f"{p:>2} {schedule:<16} {v:>2} {m:>3} {step:>8.3f} {measured:>9.3f} {theory:>7.3f} "
                f"{measured / theory:>6.2f}"
            )


ARMS = {
    "fsdp 4": {"shard_modules": ["Block"]},
    "pp 2 x fsdp 2 (1f1b, m=4)": {
        "shard_modules": ["Block"],
        "pipeline_parallel": 2,
        "pipeline_microbatches": 4,
    },
    "pp 2 x fsdp 2, hidden only": {
        "shard_modules": ["Block"],
        "pipeline_parallel": 2,
        "pipeline_microbatches": 4,
    },
}
# Arms whose model runs without its pipeline_block hook: the stages send the hidden state only, not
# the microbatch's index beside it (the hook's cost: one int64 message per microbatch and boundary).
HIDDEN_ONLY = {"pp 2 x fsdp 2, hidden only"}


def _lm(arm: str) -> Any:
    """The example transformer on the meta device (without ``pipeline_block`` for `HIDDEN_ONLY` arms)."""
    import torch

    from examples.transformer_lm import TransformerLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = TransformerLM(vocab=256, width=128, heads=4, depth=4, length=128)
    if arm in HIDDEN_ONLY:
        model.pipeline_block = None
    return model


def _speed_rank(rank: int, world_size: int, arm: str, steps: int) -> float:
    import torch
    from torch.utils.data import DataLoader

    from examples.transformer_lm import random_tokens
    from raytrain_events import Trainer
    from tests.parallel.ac_workloads import StepTimes

    timer = StepTimes()
    pipelined = "pipeline_parallel" in ARMS[arm]
    rows = 16 if pipelined else 8  # the same global batch: 2 pipelines x 16 or 4 ranks x 8
    model = _lm(arm)
    shard = rank // 2 if pipelined else rank
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(random_tokens(rows * steps, vocab=256, length=128, seed=shard), batch_size=rows),
        max_duration=f"{steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        parallelism=ARMS[arm],
        callbacks=[timer],
    )
    trainer.fit()
    trainer.close()
    return statistics.median(timer.times[2:])


def speed(repeats: int, steps: int) -> None:
    from tests.parallel.spawn import run_ranks

    times: Dict[str, List[float]] = {arm: [] for arm in ARMS}
    for _ in range(repeats):
        for arm in ARMS:
            times[arm].append(run_ranks(4, _speed_rank, arm, steps, timeout=1800)[0])
    base = statistics.median(times["fsdp 4"])
    print("Steps/s on 4 ranks (transformer width 128, 4 blocks, sequence 128, global batch 32 rows):")
    for arm, values in times.items():
        median = statistics.median(values)
        print(
            f"  {arm:<28} step {median:.3f} s [{min(values):.3f}-{max(values):.3f}]  {1 / median:6.2f} steps/s  "
            f"{base / median:.2f}x fsdp 4's steps/s"
        )


def _eval_rank(rank: int, world_size: int, arm: str, batches: int) -> float:
    from torch.utils.data import DataLoader

    from examples.transformer_lm import random_tokens
    from raytrain_events import Trainer

    pipelined = "pipeline_parallel" in ARMS[arm]
    rows = 16 if pipelined else 8  # the same global rows: 2 pipelines x 16 or 4 ranks x 8
    model = _lm(arm)
    shard = rank // 2 if pipelined else rank
    loader = DataLoader(random_tokens(rows * batches, vocab=256, length=128, seed=shard), batch_size=rows)
    trainer = Trainer(model=model, parallelism=ARMS[arm])
    trainer.eval(loader)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        trainer.eval(loader)
        times.append(time.perf_counter() - start)
    trainer.close()
    return statistics.median(times)


def evaluation(repeats: int, batches: int = 8) -> None:
    from tests.parallel.spawn import run_ranks

    times: Dict[str, List[float]] = {arm: [] for arm in ARMS}
    for _ in range(repeats):
        for arm in ARMS:
            times[arm].append(run_ranks(4, _eval_rank, arm, batches, timeout=1800)[0])
    base = statistics.median(times["fsdp 4"])
    rows = 32 * batches
    print(f"Trainer.eval on 4 ranks ({rows} rows: {batches} global batches of 32, forward only):")
    for arm, values in times.items():
        median = statistics.median(values)
        print(
            f"  {arm:<28} eval {median:.3f} s [{min(values):.3f}-{max(values):.3f}]  {rows / median:7.1f} rows/s  "
            f"{base / median:.2f}x fsdp 4's rows/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("bubble", "speed", "eval", "both"), default="both")
    parser.add_argument("--sleep-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.part in ("bubble", "both"):
        bubble(args.sleep_ms)
    if args.part in ("speed", "both"):
        speed(args.repeats, args.steps)
    if args.part == "eval":
        evaluation(args.repeats)


if __name__ == "__main__":
    main()
