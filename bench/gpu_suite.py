"""GPU suite: a GPT-2-small-class LM trained by our `Trainer` vs a plain PyTorch loop, FSDP2 vs plain,
checkpoint save/load GB/s and the training-thread blocking of an async save.

What it measures, in one process (one device), the same model, optimizer (AdamW) and data in each arm:

* **MFU** of the plain loop and of ``Trainer.fit()``: model FLOPs per token ``6 N + 12 L d s``
  (``N`` non-embedding parameters, ``L`` layers, width ``d``, sequence ``s``) times tokens per second,
  over the device's peak (``--peak-tflops``; H100/H200 SXM bf16 dense: 989). Their ratio is the
  loop's cost (goal: ours >= 0.98 of plain). On CPU the peak is unknown: the ratio of throughputs is printed.
* **host syncs per step** of each arm, counted with ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA only; goal 0).
* **FSDP2 on one device vs plain**: the plain loop on the model after ``fully_shard`` (a 1-rank group):
  what FSDP's hooks and DTensor parameters cost with nothing to shard.
* **checkpoint** save and load of model + optimizer state with ``torch.distributed.checkpoint`` to
  local disk (GB/s), and the time an async save blocks the training thread (the copy of the state
  to CPU memory, `raytrain_events.checkpoint.run.staging.HostStager`; the upload runs in the background).

Usage::

    python bench/gpu_suite.py                 # GPT-2 small (124M), sequence 1024, bf16, torch.compile
    python bench/gpu_suite.py --tiny --json   # the CPU configuration CI runs (tests/parallel/test_gpu_suite.py)

Prints one JSON object with ``--json``; see bench/README.md, "GPU suite".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from raytrain_events import Trainer  # noqa: E402
from raytrain_events.core.callback import Callback  # noqa: E402
from raytrain_events.hf import HuggingFaceModel  # noqa: E402

FULL = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, seq=1024, batch=8, warmup=5, steps=20)
TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, seq=32, batch=4, warmup=2, steps=4)


def build_model(cfg: Dict[str, int], device: torch.device) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"], vocab_size=cfg["vocab_size"],
        n_positions=cfg["seq"], bos_token_id=cfg["vocab_size"] - 1, eos_token_id=cfg["vocab_size"] - 1,
    )  # fmt: skip
    return GPT2LMHeadModel(config).to(device)


def make_batches(cfg: Dict[str, int], device: torch.device, count: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g).to(device)
        out.append({"input_ids": ids, "labels": ids})
    return out


def flops_per_token(model: torch.nn.Module, cfg: Dict[str, int]) -> float:
    embedding = sum(p.numel() for n, p in model.named_parameters() if "wte" in n or "wpe" in n)
    n = sum(p.numel() for p in model.parameters()) - embedding
    return 6.0 * n + 12.0 * cfg["n_layer"] * cfg["n_embd"] * cfg["seq"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _SyncCounter:
    """Counts host syncs (CUDA's sync debug mode warnings) inside the block; None without CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.count: Optional[int] = None

    def __enter__(self) -> _SyncCounter:
        if self.on:
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
            self._catch.__exit__(*exc)
            self.count = sum("synchroniz" in str(w.message) for w in self._seen)


def plain_loop(
    model: torch.nn.Module, batches: List[Dict[str, torch.Tensor]], cfg: Dict[str, int], device: torch.device
) -> Dict[str, Any]:
    """The plain PyTorch loop: seconds per step after warm-up, host syncs per timed step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = torch.bfloat16 if device.type == "cuda" else None

    def step(batch: Dict[str, torch.Tensor]) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[: cfg["warmup"]]:
        step(batch)
    _sync(device)
    start = time.perf_counter()
    with _SyncCounter(device) as syncs:
        for batch in batches[cfg["warmup"] :]:
            step(batch)
        _sync(device)
    seconds = (time.perf_counter() - start) / cfg["steps"]
    return {"step_s": seconds, "syncs_per_step": None if syncs.count is None else syncs.count / cfg["steps"]}


class _Clock(Callback):
    """Times the batches after warm-up of a fit, and counts their host syncs."""

    def __init__(self, warmup: int, device: torch.device) -> None:
        self.warmup, self.device = warmup, device
        self.start = self.end = 0.0
        self.syncs = _SyncCounter(device)

    def batch_end(self, state: Any, logger: Any) -> None:
        if state.timestamp.batch.value == self.warmup:
            _sync(self.device)
            self.start = time.perf_counter()
            self.syncs.__enter__()

    def fit_end(self, state: Any, logger: Any) -> None:
        _sync(self.device)
        self.end = time.perf_counter()
        self.syncs.__exit__(None, None, None)


def ours(
    model: torch.nn.Module,
    batches: List[Dict[str, torch.Tensor]],
    cfg: Dict[str, int],
    device: torch.device,
    compile: bool,
) -> Dict[str, Any]:
    clock = _Clock(cfg["warmup"], device)
    wrapped = HuggingFaceModel(model)
    trainer = Trainer(
        model=wrapped,
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizers=torch.optim.AdamW(wrapped.parameters(), lr=1e-4),
        precision="amp_bf16" if device.type == "cuda" else "fp32",
        callbacks=[clock],
        device=device,
        compile=compile,
    )
    trainer.fit()
    trainer.close()
    count = clock.syncs.count
    return {
        "step_s": (clock.end - clock.start) / cfg["steps"],
        "syncs_per_step": None if count is None else count / cfg["steps"],
    }


def fsdp_single(
    cfg: Dict[str, int], device: torch.device, batches: List[Dict[str, torch.Tensor]], compile: bool
) -> Dict[str, Any]:
    """The plain loop on the model sharded by ``fully_shard`` over a 1-rank group."""
    import torch.distributed as tdist

    from raytrain_events.parallel.config import FSDPConfig
    from raytrain_events.parallel.wrap import apply_fsdp

    started = not tdist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        model = build_model(cfg, device)
        apply_fsdp(model, FSDPConfig(shard_modules=["GPT2Block"]), 1, device)
        if compile:
            model.compile()
        return plain_loop(model, batches, cfg, device)
    finally:
        if started:
            tdist.destroy_process_group()


def checkpoint_io(model: torch.nn.Module, device: torch.device) -> Dict[str, Any]:
    """DCP save/load of model + AdamW state to local disk, and the async save's blocking copy."""
    import torch.distributed.checkpoint as dcp

    from raytrain_events.checkpoint.run.staging import HostStager

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the optimizer has its state (exp_avg, exp_avg_sq)
    tree = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(tree))
    with tempfile.TemporaryDirectory() as folder:
        _sync(device)
        start = time.perf_counter()
        dcp.save(tree, checkpoint_id=folder, no_dist=True)
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        dcp.load(tree, checkpoint_id=folder, no_dist=True)
        _sync(device)
        load_s = time.perf_counter() - start
    stager = HostStager()  # what an async save does on the training thread: the copy into reused buffers
    stager.stage(tree).release()  # the first save allocates (and pins, on CUDA) the buffers
    start = time.perf_counter()
    stager.stage(tree).release()
    block_s = time.perf_counter() - start
    return {
        "bytes": nbytes,
        "save_GBps": nbytes / save_s / 1e9,
        "load_GBps": nbytes / load_s / 1e9,
        "async_block_s": block_s,
    }


def _tensors(tree: Any) -> List[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def run(cfg: Dict[str, int], device: torch.device, compile: bool, peak_tflops: Optional[float]) -> Dict[str, Any]:
    batches = make_batches(cfg, device, cfg["warmup"] + cfg["steps"])
    plain_model = build_model(cfg, device)
    per_token = flops_per_token(plain_model, cfg)
    if compile:
        plain_model.compile()
    plain = plain_loop(plain_model, batches, cfg, device)
    del plain_model
    our = ours(build_model(cfg, device), batches, cfg, device, compile)
    fsdp = fsdp_single(cfg, device, batches, compile)
    tokens = cfg["batch"] * cfg["seq"]
    out: Dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    out["config"] = dict(cfg, compile=compile)
    for name, arm in (("plain", plain), ("ours", our), ("fsdp1", fsdp)):
        out[name] = dict(arm, tokens_per_s=tokens / arm["step_s"])
        out[name]["mfu"] = per_token * tokens / arm["step_s"] / (peak_tflops * 1e12) if peak_tflops else None
    out["ours_vs_plain"] = plain["step_s"] / our["step_s"]  # throughput ratio (= MFU ratio); goal >= 0.98
    out["fsdp1_vs_plain"] = plain["step_s"] / fsdp["step_s"]
    out["checkpoint"] = checkpoint_io(build_model(cfg, device), device)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="The tiny CPU configuration (CI).")
    parser.add_argument("--no-compile", action="store_true", help="Skip torch.compile (on by default on GPU).")
    parser.add_argument("--peak-tflops", type=float, default=None, help="Device peak (bf16 dense); H100/H200: 989.")
    parser.add_argument("--steps", type=int, default=None, help="Timed steps per arm.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    cfg = dict(TINY if args.tiny or device.type == "cpu" else FULL)
    if args.steps:
        cfg["steps"] = args.steps
    peak = args.peak_tflops
    if (
        peak is None
        and device.type == "cuda"
        and any(k in torch.cuda.get_device_name(device) for k in ("H100", "H200"))
    ):
        peak = 989.0
    compile = device.type == "cuda" and not args.no_compile
    if device.type == "cpu":
        torch.set_num_threads(1)
    result = run(cfg, device, compile, peak)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
