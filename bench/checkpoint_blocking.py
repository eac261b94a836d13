"""Training-thread blocking time per async save vs no checkpointing and vs the copy alone (issue 28 item 5).

One process, CPU, local disk: the Trainer of ``checkpoint_io.py``'s training measurement (4 x
Linear(H, H) + Linear(H, 10), ~``--mb`` MiB of parameters, SGD, batch 16, one torch thread)
saving asynchronously every ``--every`` batches, against the same run without checkpointing.

* ``blocked/save`` (gap method): median BATCH_END -> next BATCH_START gap after a save batch minus
  the median gap after other batches (the save runs inside that gap).
* ``save()``: the training thread's time inside ``Checkpointer.save()``, split into its steps at
  0.1 ms resolution (RNG capture, directory name, ``state_dict()``, the copy to host buffers,
  handing the job to the writer thread, the rest).
* ``copy alone``: the same state copied outside the loop: ``HostStager.stage`` into its reused
  buffers, and a bare ``copy_`` loop into preallocated buffers (the floor).

Goal: blocked per save <= the copy + 5 ms. On a GPU the copy is a pinned, non-blocking
device-to-host DMA (``staging.py``); here it is a memcpy.

Run: ``PYTHONPATH=$PWD python bench/checkpoint_scale.py --blocking [--mb 64] [--repeats 5]``
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch

from bench.checkpoint_io import SAVE_PARTS, _train_model, train_run
from raytrain_events.checkpoint.run.staging import HostStager

GOAL_MS = 5.0


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def copy_alone(mb: int, repeats: int, sd: Any = None) -> Dict[str, float]:
    """ms to copy the model's state: into the stager's reused buffers, and a bare preallocated copy_."""
    sd = _train_model(mb)[0].state_dict() if sd is None else sd
    stager, pre = HostStager(), {k: torch.empty_like(v) for k, v in sd.items()}
    stager.stage(sd).release()  # the first save allocates
    staged, bare = [], []
    for _ in range(2 * repeats + 1):
        t = time.perf_counter()
        stager.stage(sd).release()
        staged.append(time.perf_counter() - t)
        t = time.perf_counter()
        for k, v in sd.items():
            pre[k].copy_(v)
        bare.append(time.perf_counter() - t)
    return {"stage": _med(staged) * 1e3, "bare": _med(bare) * 1e3}


def blocking(mb: int, every: int, saves: int, repeats: int) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        train_run("async", mb, 3, 1, work)  # warm-up (allocator, first-use imports)
        runs: Dict[str, List[dict]] = {"none": [], "async": []}
        for r in range(repeats):
            for mode in ("none", "async") if r % 2 == 0 else ("async", "none"):
                runs[mode].append(train_run(mode, mb, every, saves, work))
    copy = copy_alone(mb, repeats)
    many = 2000  # the stager's walk per tensor: a state of many small tensors (an LLM has ~1-3k)
    small = copy_alone(0, repeats, {f"t{i}": torch.zeros(64) for i in range(many)})
    hidden = runs["none"][0]["hidden"]
    a, n = runs["async"], runs["none"]
    print(
        f"[blocking] local, 4x Linear({hidden},{hidden}) + Linear({hidden},10) (~{mb} MiB params), SGD, batch 16, "
        f"1 torch thread, async save every {every} ba x {saves} saves, {repeats} interleaved runs per arm"
    )
    print(
        f"    step ms (no save): none {_med([x['step'] for x in n]) * 1e3:.1f}, async {_med([x['step'] for x in a]) * 1e3:.1f}"
    )
    print(f"    gap ms after a batch without save: none {_med([x['gap_base'] for x in n]) * 1e3:.2f}")
    blocked = [x["blocked_later"] * 1e3 for x in a]
    first = _med([x["save_first"] * 1e3 for x in a])
    print(
        f"    blocked ms per async save after the first (gap method): {_med(blocked):.1f} "
        f"(runs {min(blocked):.1f}..{max(blocked):.1f}); save() of the first save (allocates the buffers): {first:.1f}"
    )
    print("    training-thread time inside Checkpointer.save(), saves after the first, median ms per save:")
    keys = SAVE_PARTS + ("TOTAL",)
    parts: Dict[str, Any] = {k: _med([x["save_parts_later"].get(k, 0.0) * 1e3 for x in a]) for k in keys}
    for k in keys:
        if k != "_write (serialize..commit)":  # runs on the writer thread for async saves: 0 here
            print(f"      {k:<34} {parts[k]:8.2f}")
    print(
        f"    copy alone, {mb} MiB: HostStager.stage (reused buffers) {copy['stage']:.2f} ms, bare copy_ {copy['bare']:.2f} ms"
    )
    over = parts["TOTAL"] - copy["stage"]
    print(
        f"    save() - copy alone = {over:.2f} ms (goal <= {GOAL_MS:.0f} ms: {'MET' if over <= GOAL_MS else 'MISSED'}); "
        f"blocked (gap) - copy alone = {_med(blocked) - copy['stage']:.2f} ms"
    )
    print(
        f"    {many} tensors of 64 floats: HostStager.stage {small['stage']:.2f} ms, bare copy_ {small['bare']:.2f} ms "
        f"({(small['stage'] - small['bare']) / many * 1e3:.2f} us per tensor for the walk and buffer lookup)"
    )
    fit_none, fit_async = _med([x["fit"] for x in n]), _med([x["fit"] for x in a])
    per_save = (fit_async - fit_none) / a[0]["n_saved"] * 1e3
    print(f"    fit() over the no-checkpoint run, per save: {per_save:.0f} ms (includes the writer's CPU use)")
