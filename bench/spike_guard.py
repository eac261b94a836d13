"""SpikeGuard: what it costs when nothing spikes, how long a spike takes to get training again, and the
ledger's answer time at 1e9 rows.

1. Overhead: the same `Trainer` loop with and without ``SpikeGuard`` (the peers' MLP 64 -> H -> H -> 10,
   batch 64, 4096 samples, 3 epochs, one thread, CPU: ~1 ms steps at H=256, as
   ``bench/loop_overhead.py``), ``fit()`` wall time per step, interleaved repeats; the guard's cost is
   one loss + gradient-norm read per batch and a host snapshot every ``snapshot_interval`` batches
   (the guard's default unless ``--snapshot-interval``); the CPU time inside its hooks per batch (less the
   timer's own cost, measured on empty hooks in the same fit) and per snapshot are given too, and the hooks'
   share of the plain step (steadier than the loop's ratio on a busy machine), split into the gradient norm, the
   snapshots and the rest; and the floor in the same loop: the norm's calls in a bare callback and a bare loss read.
2. Spike to training again: a planted row (huge input, wrong label) spikes the loss; the time from the
   start of the batch whose end agrees on the spike to the end of the rollback (snapshot restored,
   schedulers stepped, window recorded), and the model bytes restored.
3. Bisection (``SpikeGuard(bisect=True)``): 8 poisoned rows (inputs scaled by 1e4, each labelled with the
   class the initial model ranks last for it: a random label is the predicted class 1 time in 10) among
   100,000, one epoch of a cheap MLP (batch 64): culprits found, clean rows quarantined, and the search's
   compute against its window's: rows forwarded / (3 x window rows) (a forward is about a third of a
   forward + backward) and its wall time against the window's training time (batches x median step).
4. The ledger: ``Ledger.ask`` for random rows of a 3-source mixture of 1e9 rows, 3 epochs into a run
   with skipped windows; and the bytes of what it needs (mixture, seed, timestamp, skip list).

Usage::

    python bench/spike_guard.py                  # H=256, 3 repeats, the guard's default snapshot_interval
    python bench/spike_guard.py --hidden 1024 --repeats 5 --snapshot-interval 50
    python bench/spike_guard.py --only overhead --clock cpu --repeats 5   # a busy shared machine
    python bench/spike_guard.py --only overhead --loss-only                # the loss alone, no gradient norm
    python bench/spike_guard.py --only overhead --clock cpu --clip 1.0     # both loops clip; the guard shares its norm
    python bench/spike_guard.py --only overhead --clock cpu --clip 1.0 --no-share   # ... and computes its own
    python bench/spike_guard.py --only bisection                         # 8 poisoned rows among 100,000, 3 seeds
    python bench/spike_guard.py --only overhead --clock cpu --quarantined 100000   # a guard holding 1e5 culprit rows

This file puts its own tree first on ``sys.path`` (whatever ``PYTHONPATH`` says): to compare two trees, run each
tree's own copy (``cd /work/wt/base && python bench/spike_guard.py ...``); the output's ``package`` names the tree
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from raytrain_events import Trainer  # noqa: E402
from raytrain_events.algorithms import GradientClipping  # noqa: E402
from raytrain_events.callbacks import SpikeGuard, spike_norm  # noqa: E402
from raytrain_events.callbacks import spike_guard as guard_module  # noqa: E402
from raytrain_events.checkpoint.run.host_snapshot import HostSnapshots  # noqa: E402
from raytrain_events.core.agreement import Agreement  # noqa: E402
from raytrain_events.core.ledger import Ledger  # noqa: E402
from raytrain_events.core.mixture import Mixture  # noqa: E402
from raytrain_events.core.spikes import SkipList, SkipRange  # noqa: E402
from raytrain_events.models import ClassifierModel  # noqa: E402

torch.set_num_threads(1)
N, D, C, B = 4096, 64, 10, 64


def _data(planted=None):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)
    if planted is not None:
        x[planted] *= 1e4
    return x, y


def _trainer(hidden, x, y, guard, extra=()):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, C))
    model = ClassifierModel(net, num_classes=C)
    return Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, y), batch_size=B),
        max_duration="3ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=[*extra, *([guard] if guard is not None else [])],
        algorithms=[GradientClipping("norm", CLIP)] if CLIP is not None else [],
    )


CLOCK = time.perf_counter  # --clock cpu: this thread's CPU time (the loop runs on one thread), for a busy machine


def _per_step(trainer):
    start = CLOCK()
    state = trainer.fit()
    return (CLOCK() - start) / int(state.timestamp.batch)


GRAD_ZSCORE = 6.0  # --loss-only: None (no gradient norm per batch)
CLIP = None  # --clip T: GradientClipping("norm", T) in both loops
QUARANTINED = 0  # --quarantined N: rows in the guard's quarantine


def _guard(interval):
    """The guard as benchmarked: ``interval`` None is its default ``snapshot_interval``; with ``--quarantined N`` its
    state holds N quarantined rows (as after a ``quarantine_from`` file: its checkpointed state, not its filter)."""
    knobs = {} if interval is None else {"snapshot_interval": interval}
    guard = SpikeGuard(grad_zscore=GRAD_ZSCORE, **knobs)
    for row in range(QUARANTINED):
        guard.quarantine.add(N + 7 * row, 0, row)  # ids no batch of this data carries
    return guard


def overhead(hidden, repeats, interval):
    x, y = _data()
    _per_step(_trainer(hidden, x, y, None))  # warm-up
    plain, guarded = [], []
    for _ in range(repeats):
        plain.append(_per_step(_trainer(hidden, x, y, None)))
        guarded.append(_per_step(_trainer(hidden, x, y, _guard(interval))))
    ratios = [g / p for g, p in zip(guarded, plain)]
    costs = [guard_cost(hidden, interval) for _ in range(repeats)]
    step_us = statistics.median(plain) * 1e6
    hooks = [c[0] for c in costs]

    def share(us):  # a median of per-batch CPU as a percentage of the plain step
        return round(100 * statistics.median(us) / step_us, 2)

    parts = {name: [c[3][name] for c in costs] for name in costs[0][3]}
    return {
        "snapshot_interval": _guard(interval).snapshot_interval,
        "guard_hooks_us_per_batch": hooks,
        "guard_hooks_percent_of_step": share(hooks),
        # Where the hooks' CPU goes, per batch and as a share of the plain step: the gradient norm (`grad_norm`, 0
        # when the loss is judged alone or a GradientClipping shares its norm), the snapshots (each one's CPU over
        # the batches: the interval's amortised cost) and the rest (the loss read, the detector, the bookkeeping);
        # and, outside the hooks, the loop's reading of the guard's agreement flag each batch.
        "parts_us_per_batch": parts,
        "parts_percent_of_step": {name: share(values) for name, values in parts.items()},
        "timer_us_per_hook_call": [c[2] for c in costs],
        "snapshot_us_each": [c[1] for c in costs],
        # What no guard gets under, in the same loop: the gradient norm's kernels and a bare loss read (`floor`).
        "floor_us_per_batch": floor(hidden),
        "plain_ms": [round(v * 1e3, 4) for v in plain],
        "guard_ms": [round(v * 1e3, 4) for v in guarded],
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
    }


class _LossRead(guard_module.Callback):
    """A bare judgment: read the loss and compare it, timed inside its hook (the floor of any per-batch loss test)."""

    def __init__(self):
        self.spent = []

    def batch_end(self, state, logger):
        start = time.thread_time_ns()
        if not state.loss.item() < 1e30:
            raise AssertionError("a loss of 1e30")
        self.spent.append(time.thread_time_ns() - start)


class _NormCalls(_LossRead):
    """The gradient norm's calls alone (one ``vector_norm`` per gradient, the norm of those, read), at the guard's
    point (after backward, before the step), timed inside the hook: its kernels, without the guard's Python."""

    params = None

    def after_train_batch(self, state, logger):
        params = self.params = self.params or list(state.model.parameters())  # found once, as the guard does
        start = time.thread_time_ns()
        grads = [p.grad for p in params]
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        self.spent.append(time.thread_time_ns() - start)

    batch_end = guard_module.Callback.batch_end  # (not overridden: the Engine skips it)


def floor(hidden):
    """Medians per batch of a `_NormCalls` fit and a `_LossRead` fit, less the timer's own cost (`_Timer`'s hooks in
    the same fits): what the guard's norm and its per-batch judgment cannot go under, by this loop's measure."""
    x, y = _data()
    out = {}
    for name, probe in (("norm_calls", _NormCalls()), ("loss_read", _LossRead())):
        timer = _Timer()
        _trainer(hidden, x, y, None, extra=[timer, probe]).fit()
        out[name] = round((statistics.median(probe.spent) - statistics.median(timer.spent)) / 1e3, 1)
    return out


class _Timer(guard_module.Callback):
    """Hooks that time nothing: the timer's own cost, in the same fit."""

    def __init__(self):
        self.spent = []

    def after_train_batch(self, state, logger):
        start = time.thread_time_ns()
        self.spent.append(time.thread_time_ns() - start)

    batch_end = after_train_batch


class _Empty(guard_module.Callback):
    """Hooks on the guard's per-batch events that do nothing: timed like the guard's, they measure the timer itself."""

    def after_train_batch(self, state, logger):
        pass

    def batch_end(self, state, logger):
        pass


def guard_cost(hidden, interval):
    """CPU time inside the guard's per-batch hooks (after_train_batch + batch_end, snapshots included), per
    batch: what the ratio measures, without the noise of the loop around it; and per snapshot (its
    ``HostSnapshots.take``, inside those hooks; the fit's first one excluded: it is taken at FIT_START).
    The timer's own cost (two ``thread_time_ns`` reads around each hook call, measured on `_Empty`'s hooks in the
    same fit, median per call) is taken off: what is left is the guard's."""
    spent, snaps, empty, norms, sums = [0, 0], [], [], [], []
    originals = {name: getattr(guard_module.SpikeGuard, name) for name in ("after_train_batch", "batch_end")}
    take, norm, set_sums = HostSnapshots.take, guard_module.grad_norm, Agreement.set_sums

    def timed_sums(self, values):
        start = time.thread_time_ns()
        set_sums(self, values)
        sums.append(time.thread_time_ns() - start)

    def timed_norm(guard, state):
        start = time.thread_time_ns()
        out = norm(guard, state)
        norms.append(time.thread_time_ns() - start)
        return out

    def timed_take(self, meta):
        start = time.thread_time_ns()
        take(self, meta)
        snaps.append(time.thread_time_ns() - start)

    def timed(original):
        def hook(self, state, logger):
            start = time.thread_time_ns()
            original(self, state, logger)
            spent[0] += time.thread_time_ns() - start
            spent[1] += 1

        return hook

    def timed_empty(self, state, logger):
        start = time.thread_time_ns()
        empty.append(time.thread_time_ns() - start)

    for name, original in originals.items():
        setattr(guard_module.SpikeGuard, name, timed(original))
        setattr(_Empty, name, timed_empty)
    HostSnapshots.take, guard_module.grad_norm, Agreement.set_sums = timed_take, timed_norm, timed_sums
    try:
        x, y = _data()
        state = _trainer(hidden, x, y, _guard(interval), extra=[_Empty()]).fit()
    finally:
        for name, original in originals.items():
            setattr(guard_module.SpikeGuard, name, original)
        HostSnapshots.take, guard_module.grad_norm, Agreement.set_sums = take, norm, set_sums
    in_loop = snaps[1:]
    per_snapshot = round(statistics.median(in_loop) / 1e3, 1) if in_loop else None
    timer = statistics.median(empty)
    batches = int(state.timestamp.batch)
    guard = (spent[0] - timer * spent[1]) / batches
    # (the norm's and the snapshots' own timers, one read pair each, are inside the hooks' total: taken off the rest)
    parts = {
        "norm": (sum(norms) - timer * len(norms)) / batches,
        "snapshots": (sum(in_loop) - timer * len(in_loop)) / batches,
    }
    parts["rest"] = guard - parts["norm"] - parts["snapshots"] - timer * (len(norms) + len(in_loop)) / batches
    # Outside the hooks: the loop's reading of the per-batch flags (`Agreement.set_sums`; the plain loop registers none)
    parts["agreement_outside_hooks"] = (sum(sums) - timer * len(sums)) / batches
    parts = {name: round(value / 1e3, 1) for name, value in parts.items()}
    return round(guard / 1e3, 1), per_snapshot, round(timer / 1e3, 2), parts


def spike_to_training(hidden, interval):
    x, y = _data(planted=N // 2 + 5)
    timings = []
    original = guard_module.roll_back  # the name the guard's batch_end calls (callbacks/spike_rollback.py's)

    def timed(guard, state, logger, *args):
        start = time.perf_counter()
        original(guard, state, logger, *args)
        timings.append(time.perf_counter() - start)

    guard_module.roll_back = timed
    try:
        guard = SpikeGuard(snapshot_interval=interval)
        state = _trainer(hidden, x, y, guard).fit()
    finally:
        guard_module.roll_back = original
    model_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters())
    return {
        "rollbacks": len(guard.rollbacks),
        "rollback_ms": [round(t * 1e3, 3) for t in timings],
        "batches_skipped": guard.skips.totals()[0],
        "model_bytes": model_bytes,
    }


class _Batches(torch.utils.data.Dataset):
    """Dict batches of ``batch`` rows with an ``id`` column (the row number), cut from whole tensors."""

    def __init__(self, x, y, batch):
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return {"x": self.x[rows], "y": self.y[rows], "id": torch.arange(len(self.x))[rows]}


def bisection(rows=100_000, poisoned=8, hidden=64, interval=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, D, generator=g), torch.randint(0, C, (rows,), generator=g)
    planted = sorted(random.Random(seed).sample(range(rows), poisoned))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, C))
    with torch.no_grad():  # scaled and scrambled: a huge input labelled with the class the model ranks last for it
        for i in planted:  # (a random label is, 1 time in 10, the class it predicts: a loss of 0, no spike to find)
            x[i] *= 1e4
            y[i] = int(net(x[i : i + 1]).argmin())
    model = ClassifierModel(net, num_classes=C)
    guard = SpikeGuard(snapshot_interval=interval, bisect=True, row_key="id", max_rollbacks=4 * poisoned)
    steps = []

    class Steps(guard_module.Callback):
        def batch_start(self, state, logger):
            self.t = time.perf_counter()

        def batch_end(self, state, logger):
            steps.append(time.perf_counter() - self.t)

    start = time.perf_counter()
    state = Trainer(
        model=model,
        train_dataloader=DataLoader(_Batches(x, y, B), batch_size=None),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=[Steps(), guard],
    ).fit()
    wall = time.perf_counter() - start
    found = guard.quarantine.ids()
    step = statistics.median(steps)
    per = [
        {
            "window_rows": r["window_rows"],
            "search_rows": r["search_rows"],
            "compute_ratio": round(r["search_rows"] / (3 * r["window_rows"]), 3),
            "time_ratio": round(r["search_s"] / ((r["batch"] - r["restored_batch"]) * step), 3),
            "quarantined": r["quarantined"],
        }
        for r in guard.rollbacks
        if "search_rows" in r
    ]
    missed = [i for i in planted if i not in found]
    with torch.no_grad():  # a missed row's loss under the final model (~0: it was trained, and its label fits now)
        missed_loss = {i: round(float(model.loss(model({"x": x[i : i + 1]}), {"y": y[i : i + 1]})), 3) for i in missed}
    return {
        "rows": rows,
        "poisoned": planted,
        "missed_row_loss": missed_loss,
        "found": len(set(found) & set(planted)),
        "clean_quarantined": len(set(found) - set(planted)),
        "rollbacks": len(guard.rollbacks),
        "windows_skipped": len(guard.skips.ranges),
        "compute_ratio_max": max((p["compute_ratio"] for p in per), default=None),
        "time_ratio_median": statistics.median([p["time_ratio"] for p in per]) if per else None,
        "time_ratio_max": max((p["time_ratio"] for p in per), default=None),
        "step_ms_median": round(step * 1e3, 3),
        "fit_s": round(wall, 2),
        "batches": int(state.timestamp.batch),
        "per_rollback": per,
    }


def ledger(rows_total=10**9, questions=200):
    third = rows_total // 3
    mixture = Mixture(
        sources={"web": third, "code": third, "math": rows_total - 2 * third},
        stages={
            "0sp": {"web": 0.5, "code": 0.3, "math": 0.2},
            f"{rows_total // 2}sp": {"web": 0.2, "code": 0.3, "math": 0.5},
        },
        epoch_size=rows_total,
    )
    plan = mixture.plan(seed=17)
    skips = SkipList([SkipRange(e, s, s + 4096, 4, 0) for e, s in ((0, 123_456_789), (1, 7_000_000), (2, 900_000_000))])
    led = Ledger(plan=plan, epoch=3, position=rows_total // 3, skips=skips)
    rng = random.Random(0)
    times = []
    for _ in range(questions):
        source = rng.choice(plan.names)
        row = rng.randrange(plan.source_rows[plan.names.index(source)])
        start = time.perf_counter()
        led.ask(source, row)
        times.append(time.perf_counter() - start)
    state = {
        "mixture": mixture.to_dict(),
        "seed": 17,
        "epoch": 3,
        "position": rows_total // 3,
        "skips": skips.state_dict(),
    }
    return {
        "rows": rows_total,
        "ask_ms_median": round(statistics.median(times) * 1e3, 3),
        "ask_ms_max": round(max(times) * 1e3, 3),
        "state_bytes": len(json.dumps(state)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--snapshot-interval", type=int, default=None, help="default: the guard's own default")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--only", choices=["overhead", "spike", "bisection", "ledger"], default=None)
    parser.add_argument("--seeds", type=int, default=3, help="bisection: runs with other poisoned rows")
    parser.add_argument("--loss-only", action="store_true", help="SpikeGuard(grad_zscore=None): no gradient norm")
    parser.add_argument("--clip", type=float, default=None, help="GradientClipping('norm', CLIP) in both loops")
    parser.add_argument("--no-share", action="store_true", help="the guard computes its own norm beside the clipping's")
    parser.add_argument("--quarantined", type=int, default=0, help="overhead: rows in the guard's quarantine")
    args = parser.parse_args()
    global CLOCK, GRAD_ZSCORE, CLIP, QUARANTINED
    QUARANTINED = args.quarantined
    CLIP = args.clip
    if args.no_share:
        spike_norm.shared_clipping = lambda state, params: None  # the name spike_norm.find_params calls
    GRAD_ZSCORE = None if args.loss_only else 6.0
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    parts = {
        "overhead": lambda: overhead(args.hidden, args.repeats, args.snapshot_interval),
        "spike": lambda: spike_to_training(args.hidden, args.snapshot_interval or 20),
        "bisection": lambda: [bisection(seed=seed) for seed in range(args.seeds)],
        "ledger": ledger,
    }
    out = {name: run() for name, run in parts.items() if args.only in (None, name)}
    out["clock"], out["loss_only"], out["load"] = args.clock, args.loss_only, os.getloadavg()
    out["clip"], out["shared"] = args.clip, args.clip is not None and not args.no_share
    out["package"] = os.path.dirname(sys.modules["raytrain_events"].__file__)  # the tree measured (see the docstring)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
