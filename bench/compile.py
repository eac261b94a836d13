"""torch.compile: `Trainer(compile=...)` step time vs the same Trainer in eager mode, one process, CPU.

An MLP 256 -> H -> H -> H -> 10 (GELU, LayerNorm), batch 128; each repeat builds a fresh Trainer
for eager and for compiled (interleaved, so machine noise hits both alike), trains ``--steps``
batches and times the steps after ``--warmup`` (the compiled run compiles on its first steps; that
one-off cost is reported separately). Prints per-repeat step times, medians with min-max spreads,
and the ratio compiled / eager (< 1 means compile helps).

Usage::

    python bench/compile.py                         # H=512, 3 repeats
    python bench/compile.py --hidden 1024 --repeats 5 --mode max-autotune-no-cudagraphs
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, Trainer


class Net(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: List[torch.nn.Module] = [torch.nn.Linear(256, hidden)]
        for _ in range(2):
            layers += [torch.nn.GELU(), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, hidden)]
        layers += [torch.nn.GELU(), torch.nn.Linear(hidden, 10)]
        self.body = torch.nn.Sequential(*layers)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.body(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, batch[1])


class StepTimes(Callback):
    def __init__(self) -> None:
        self.ends: List[float] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.ends.append(time.perf_counter())


def run(hidden: int, steps: int, warmup: int, compile: Any) -> Dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 128, 256, generator=g)
    y = torch.randint(0, 10, (steps * 128,), generator=g)
    model, times = Net(hidden), StepTimes()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, y), batch_size=128),
        max_duration=f"{steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        callbacks=[times],
        compile=compile,
    )
    start = time.perf_counter()
    trainer.fit()
    steady = [b - a for a, b in zip(times.ends[warmup:], times.ends[warmup + 1 :])]
    return {"first_steps_s": times.ends[warmup] - start, "step_ms": 1000 * statistics.median(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: torch's default)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled_option: Any = {"mode": args.mode} if args.mode else True
    eager_ms, compiled_ms, compile_s = [], [], []
    for repeat in range(args.repeats):
        torch._dynamo.reset()  # each compiled repeat compiles afresh (the on-disk cache may still help)
        for name, option in (("eager", False), ("compiled", compiled_option)):
            result = run(args.hidden, args.steps, args.warmup, option)
            (eager_ms if name == "eager" else compiled_ms).append(result["step_ms"])
            if name == "compiled":
                compile_s.append(result["first_steps_s"])
            print(
                f"repeat {repeat} {name:8s} step {result['step_ms']:.2f} ms, first {args.warmup} steps "
                f"{result['first_steps_s']:.1f} s",
                flush=True,
            )
    e, c = statistics.median(eager_ms), statistics.median(compiled_ms)
    print(f"H={args.hidden} batch=128 threads={args.threads} mode={args.mode or 'default'}")
    print(f"eager    median {e:.2f} ms/step (min {min(eager_ms):.2f}, max {max(eager_ms):.2f})")
    print(
        f"compiled median {c:.2f} ms/step (min {min(compiled_ms):.2f}, max {max(compiled_ms):.2f}); "
        f"first {args.warmup} steps incl. compiling: median {statistics.median(compile_s):.1f} s"
    )
    print(f"ratio compiled/eager: {c / e:.3f}")


if __name__ == "__main__":
    main()
