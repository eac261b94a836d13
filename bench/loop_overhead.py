"""Loop overhead: raytrain_events.Trainer vs a plain PyTorch loop, same model/data, one process, CPU.

Measured the same way as the project's Composer peer script, so the ratios compare with the peer
table in bench/README.md: an MLP 64 -> H -> H -> 10, batch 64, 4096 samples, 3 epochs,
``torch.set_num_threads(1)``, ``fit()`` wall time per step (Trainer construction excluded, as in
the peer script), median of 5 interleaved repeats after a warm-up.

Peak memory is the peak resident set size of a fresh subprocess that runs only one of the two
loops (warm-up + 3 epochs): torch's CPU tensors live outside Python's allocator, so
``tracemalloc`` cannot see them, and torch 2.13 has no CPU allocator statistics. Importing torch
peaks higher than this small training run, so the child resets the kernel's high-water mark
(``echo 5 > /proc/self/clear_refs``) once data is built and reads ``VmHWM`` after training; where
that reset is not allowed it falls back to ``ru_maxrss``. Both children import the same modules
(torch and raytrain_events), so the comparison is of what training costs, not of import size.

Usage::

    python bench/loop_overhead.py 256          # H=256
    python bench/loop_overhead.py 1024         # H=1024
    python bench/loop_overhead.py 256 --repeats 9 --no-memory
    python bench/loop_overhead.py 256 --breakdown    # + plain loop calling the model through ClassifierModel
    python bench/loop_overhead.py 256 --clock cpu    # thread CPU time (a busy shared machine)
    python bench/loop_overhead.py 256 --bytecodes    # deterministic: Python bytecodes per step, by function
    python bench/loop_overhead.py 256 --instructions # deterministic: x86 instructions per step (valgrind)
    python bench/loop_overhead.py 256 --instructions --cache-sim  # + simulated cache misses, mispredicts

See bench/README.md for how to read the output and the numbers last measured.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import raytrain_events  # noqa: E402  (imported in both arms so memory compares like for like)
from raytrain_events.models import ClassifierModel  # noqa: E402

torch.set_num_threads(1)
N, D, C, B = 4096, 64, 10, 64
# Wall time, as the peer scripts. ``--clock cpu`` switches to this thread's CPU time, which leaves
# out the time the OS gave to other processes: use it to compare on a busy shared machine.
CLOCK = time.perf_counter


def data(hidden: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)


def make(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, C))


def raw(hidden: int, X, Y, epochs: int) -> float:
    """The peer scripts' plain loop, verbatim."""
    m = make(hidden)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dl = DataLoader(TensorDataset(X, Y), batch_size=B, shuffle=False)
    t = CLOCK()
    steps = 0
    for _ in range(epochs):
        for x, y in dl:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            steps += 1
    return (CLOCK() - t) / steps


def ours(hidden: int, X, Y, epochs: int) -> float:
    """raytrain_events.Trainer with the same module wrapped in the model protocol (no callbacks)."""
    m = ClassifierModel(make(hidden), num_classes=C)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dl = DataLoader(TensorDataset(X, Y), batch_size=B, shuffle=False)
    tr = raytrain_events.Trainer(model=m, train_dataloader=dl, max_duration=f"{epochs}ep", optimizers=opt)
    t = CLOCK()
    tr.fit()
    el = CLOCK() - t
    return el / (epochs * len(dl))


def raw_protocol(hidden: int, X, Y, epochs: int) -> float:
    """The plain loop, but calling the model through the protocol (``ClassifierModel`` forward + loss).

    Only with ``--breakdown``: it splits our overhead into the model wrapper's share and the loop's.
    """
    m = ClassifierModel(make(hidden), num_classes=C)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    dl = DataLoader(TensorDataset(X, Y), batch_size=B, shuffle=False)
    t = CLOCK()
    steps = 0
    for _ in range(epochs):
        for batch in dl:
            opt.zero_grad()
            loss = m.loss(m(batch), batch)
            loss.backward()
            opt.step()
            steps += 1
    return (CLOCK() - t) / steps


ARMS = {"raw": raw, "ours": ours, "raw_protocol": raw_protocol}


def timing(hidden: int, repeats: int, arms=("raw", "ours")) -> dict:
    X, Y = data(hidden)
    for arm in arms:
        ARMS[arm](hidden, X, Y, 1)  # warm-up
    runs = {arm: [] for arm in arms}
    for i in range(repeats):
        # Interleave, alternating which arm goes first, so drift and neighbours hit both alike.
        for arm in arms if i % 2 == 0 else arms[::-1]:
            runs[arm].append(ARMS[arm](hidden, X, Y, 3))
    return {arm: statistics.median(v) for arm, v in runs.items()} | {"all": runs}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_child(arm: str, hidden: int) -> None:
    X, Y = data(hidden)
    before = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    ARMS[arm](hidden, X, Y, 1)
    ARMS[arm](hidden, X, Y, 3)
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"arm": arm, "before_mib": before / 1024, "peak_mib": peak / 1024, "hwm_reset": reset}))


def memory(hidden: int, repeats: int = 3) -> dict:
    """Median over ``repeats`` fresh subprocesses per arm (interleaved) of RSS before and peak RSS during training."""
    out: dict = {}
    for arm in ("raw", "ours") * repeats:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), str(hidden), "--memory-child", arm],
            check=True,
            capture_output=True,
            text=True,
        )
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        out.setdefault(arm, []).append(rec)
    return {
        arm: {
            "before_mib": statistics.median(r["before_mib"] for r in recs),
            "peak_mib": statistics.median(r["peak_mib"] for r in recs),
            "hwm_reset": all(r["hwm_reset"] for r in recs),
        }
        for arm, recs in out.items()
    }


def _per_step_counts(hidden: int, arm: str, counter) -> collections.Counter:
    """``counter(fn)`` counts something while ``fn`` runs; per step = (2 epochs - 1 epoch) / 64, so set-up cancels."""
    X, Y = data(hidden)
    ARMS[arm](hidden, X, Y, 1)  # warm-up
    one = counter(lambda: ARMS[arm](hidden, X, Y, 1))
    two = counter(lambda: ARMS[arm](hidden, X, Y, 2))
    steps = N // B
    return collections.Counter({k: (two[k] - one[k]) / steps for k in set(one) | set(two)})


def _count_bytecodes(fn) -> collections.Counter:
    counts: collections.Counter = collections.Counter()

    def local(frame, event, arg):
        if event == "opcode":
            code = frame.f_code
            counts[
                f"{os.path.relpath(code.co_filename, ROOT) if code.co_filename.startswith(ROOT) else code.co_filename.split('site-packages/')[-1]}:{code.co_name}"
            ] += 1
        return local

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts


def bytecodes(hidden: int, top: int = 25) -> None:
    """Deterministic: Python bytecodes executed per step by each arm, and where ours adds them."""
    raw_c = _per_step_counts(hidden, "raw", _count_bytecodes)
    ours_c = _per_step_counts(hidden, "ours", _count_bytecodes)
    r, o = sum(raw_c.values()), sum(ours_c.values())
    print(f"hidden={hidden} bytecodes/step raw={r:.0f} ours={o:.0f} extra={o - r:.0f}")
    extra = {k: ours_c[k] - raw_c[k] for k in set(raw_c) | set(ours_c)}
    for name, value in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:top]:
        if abs(value) >= 1:
            print(f"  {value:+8.1f}  {name}")


def _callgrind_child(hidden: int) -> None:
    """Run under ``valgrind --tool=callgrind --instr-atstart=no`` (see `instructions`): after a warm-up,
    instrument each arm's 1-epoch and 3-epoch fit, dumping the counts after each."""
    X, Y = data(hidden)
    for arm in ("raw", "ours"):
        ARMS[arm](hidden, X, Y, 1)

    def control(*flags: str) -> None:  # callgrind_control returns once the running process has obeyed
        subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True, capture_output=True)

    control("--instr=on")
    control("--zero")
    for arm in ("raw", "ours"):
        for epochs in (1, 3):
            ARMS[arm](hidden, X, Y, epochs)
            control(f"--dump={arm}-{epochs}")


# --cache-sim: valgrind's cache model with this machine's L1 (32 KiB, 8-way) and its 512 KiB L2 as the
# "last level", so an LL miss is an access that leaves the core's private caches.
_CACHE_SIM = ["--cache-sim=yes", "--branch-sim=yes", "--D1=32768,8,64", "--I1=32768,8,64", "--LL=524288,8,64"]
# Rough cycle weights for an estimate of what the extra events cost (an L2 hit, an L3 hit, a mispredict).
_WEIGHTS = {"Ir": 1, "I1mr": 10, "D1mr": 10, "D1mw": 10, "ILmr": 40, "DLmr": 40, "DLmw": 40, "Bcm": 15, "Bim": 15}


def instructions(hidden: int, cache_sim: bool = False) -> None:
    """Deterministic: x86 instructions per step of each arm, counted by valgrind's callgrind (minutes).

    Only the fits are instrumented (toggled on after import and warm-up). "per step" is (3-epoch fit
    - 1-epoch fit) / 128 steps, so set-up cancels; "per step of a 3-epoch fit" is what the timing
    divides (fit wall time / 192 steps), fit set-up included. ``cache_sim`` also simulates caches and
    branch prediction (about twice as slow) and prints misses and mispredicts per step: the extra Python
    of our loop runs between MKL calls that evict it, so it costs far more cycles per instruction."""
    import re
    import shutil
    import tempfile

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (e.g. `apt-get install valgrind`).")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.out"]
            + (_CACHE_SIM if cache_sim else [])
            + [sys.executable, os.path.abspath(__file__), str(hidden), "--callgrind-child"],
            check=True,
            capture_output=True,
        )
        events: dict = {}
        for name in os.listdir(out):
            text = open(os.path.join(out, name)).read()
            label = re.search(r"^desc: Trigger: dump (\S+)$", text, re.M)
            if label:
                names = re.search(r"^events: (.+)$", text, re.M).group(1).split()
                values = re.search(r"^totals: (.+)$", text, re.M).group(1).split()
                events[label.group(1)] = dict(zip(names, map(int, values)))
    steps = N // B
    totals = {label: counts["Ir"] for label, counts in events.items()}
    step = {arm: (totals[f"{arm}-3"] - totals[f"{arm}-1"]) / (2 * steps) for arm in ("raw", "ours")}
    fit = {arm: totals[f"{arm}-3"] / (3 * steps) for arm in ("raw", "ours")}
    print(
        f"hidden={hidden} instructions/step raw={step['raw'] / 1e6:.3f}M ours={step['ours'] / 1e6:.3f}M "
        f"extra={(step['ours'] - step['raw']) / 1e3:+.1f}k ratio={step['ours'] / step['raw']:.4f}"
    )
    print(
        f"  per step of a 3-epoch fit (set-up included): raw={fit['raw'] / 1e6:.3f}M ours={fit['ours'] / 1e6:.3f}M "
        f"ratio={fit['ours'] / fit['raw']:.4f}"
    )
    if cache_sim:
        per = {
            arm: {e: (events[f"{arm}-3"][e] - events[f"{arm}-1"][e]) / (2 * steps) for e in events[f"{arm}-3"]}
            for arm in ("raw", "ours")
        }
        for e in per["raw"]:
            r, o = per["raw"][e], per["ours"][e]
            print(f"  {e:5s} raw={r:11.0f} ours={o:11.0f} extra={o - r:+9.0f}")
        extra = sum(w * (per["ours"][e] - per["raw"][e]) for e, w in _WEIGHTS.items())
        print(
            f"  extra cycles/step (estimate: Ir + 10 x L1 misses + 40 x L2 misses + 15 x mispredicts) = {extra / 1e3:+.1f}k"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hidden", nargs="?", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the plain loop calling the model through the protocol wrapper",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter (as the peers); cpu: time.thread_time (busy machines)",
    )
    parser.add_argument(
        "--bytecodes", action="store_true", help="count Python bytecodes per step instead of timing (deterministic)"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count x86 instructions per step with valgrind's callgrind instead of timing (deterministic)",
    )
    parser.add_argument(
        "--cache-sim",
        action="store_true",
        help="with --instructions: also simulate caches and branch prediction (misses/mispredicts per step)",
    )
    parser.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", choices=sorted(ARMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.memory_child:
        _memory_child(args.memory_child, args.hidden)
        return
    if args.callgrind_child:
        _callgrind_child(args.hidden)
        return
    if args.instructions:
        instructions(args.hidden, args.cache_sim)
        return
    if args.bytecodes:
        bytecodes(args.hidden)
        return
    arms = ("raw", "ours", "raw_protocol") if args.breakdown else ("raw", "ours")
    t = timing(args.hidden, args.repeats, arms)
    print(
        f"hidden={args.hidden} clock={args.clock} repeats={args.repeats} raw_step_us={t['raw'] * 1e6:.1f} "
        f"ours_step_us={t['ours'] * 1e6:.1f} ratio={t['ours'] / t['raw']:.3f}"
    )
    if args.breakdown:
        print(
            f"  raw_protocol_step_us={t['raw_protocol'] * 1e6:.1f} (model wrapper share "
            f"{(t['raw_protocol'] - t['raw']) * 1e6:+.1f} us, loop share {(t['ours'] - t['raw_protocol']) * 1e6:+.1f} us)"
        )
    for arm in arms:
        print(f"  {arm:12s} runs (us): " + " ".join(f"{v * 1e6:.1f}" for v in t["all"][arm]))
    if not args.no_memory:
        m = memory(args.hidden)
        r, o = m["raw"], m["ours"]
        how = "VmHWM after reset" if r["hwm_reset"] and o["hwm_reset"] else "ru_maxrss (no HWM reset)"
        print(
            f"hidden={args.hidden} peak_rss_mib raw={r['peak_mib']:.1f} ours={o['peak_mib']:.1f} "
            f"ratio={o['peak_mib'] / r['peak_mib']:.3f} [{how}] (rss before training: raw={r['before_mib']:.1f} "
            f"ours={o['before_mib']:.1f}; training adds raw={r['peak_mib'] - r['before_mib']:.1f} "
            f"ours={o['peak_mib'] - o['before_mib']:.1f})"
        )


if __name__ == "__main__":
    main()
