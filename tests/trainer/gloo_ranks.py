"""Spawned gloo ranks (no Ray) running `Trainer` with `TorchDist`: helpers for tests/trainer.

`run_ranks(fn, world_size, **kwargs)` starts ``world_size`` processes with
``torch.multiprocessing.start_processes`` (forked from a server
that has imported torch: `rank_processes`), forms a gloo process group on 127.0.0.1, runs
``fn(rank, world_size, **kwargs)`` in each and returns the ranks' results in rank order.
``cuda=True`` makes GPU ``r % device_count`` rank ``r``'s current device (ranks may share one);
``train(..., device="cuda")`` trains there. ``backend="nccl"`` needs a GPU per rank.
`run_ranks(run_jobs, world_size, jobs=[(fn, kwargs), ...])` runs several jobs in one spawn.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from rank_processes import rank_start_method
from torch.utils.data import DataLoader, Dataset

from raytrain_events import Callback, DataSpec, Event, Trainer
from raytrain_events.dist import TorchDist

BATCHES = 5  # batches per epoch, the same on every rank (DDP needs it); sizes differ per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    kwargs: Dict[str, Any],
    backend: str = "gloo",
    cuda: bool = False,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # the child's own environment
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    tdist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result: Any = fn(rank, world_size, **kwargs)
    except BaseException:
        result = {"error": traceback.format_exc()}
    finally:
        tdist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # The result is on disk: skip the interpreter's teardown, where about one spawned process in
    # ten aborted in torch's static destructors ("terminate called without an active exception"),
    # after its group was destroyed, and the rank read as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *, backend: str = "gloo", cuda: bool = False, **kwargs: Any
) -> List[Any]:
    """Run ``fn`` on ``world_size`` spawned ranks (gloo unless ``backend``); re-raise the first rank's error."""
    with tempfile.TemporaryDirectory() as out_dir:
        args = (world_size, _free_port(), out_dir, fn, kwargs, backend, cuda)
        mp.start_processes(_entry, args=args, nprocs=world_size, join=True, start_method=rank_start_method())
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "error" in result:
            raise AssertionError(f"rank {rank} failed:\n{result['error']}")
    return results


def run_jobs(rank: int, world_size: int, *, jobs: Sequence[Tuple[Callable[..., Any], Dict[str, Any]]]) -> List[Any]:
    """Several jobs ``(fn, kwargs)`` one after another on the same ranks and process group: one spawn
    (a torch import and a gloo rendezvous per rank, seconds each on a loaded machine) for all of them.

    A job that raises gives ``{"error": traceback}`` in its place and the next job still runs (a rank
    that failed alone leaves its peers waiting in a collective, as with one job per spawn)."""
    results: List[Any] = []
    for fn, kwargs in jobs:
        try:
            results.append(fn(rank, world_size, **kwargs))
        except Exception:
            results.append({"error": traceback.format_exc()})
    return results


def job_results(ranks: List[List[Any]], index: int) -> List[Any]:
    """Job ``index``'s result on every rank, from `run_ranks(run_jobs, ...)`; fails naming a rank's error."""
    results = [per_rank[index] for per_rank in ranks]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "error" in result:
            raise AssertionError(f"rank {rank} failed:\n{result['error']}")
    return results


# ------------------------------------------------------------------------------------ the job
class TokenRows(Dataset):
    """Rows ``(x, y, tokens)``: the token count of each row is large (sums beyond 2**24) and varies."""

    def __init__(self, rank: int, rows: int) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(rows, 6, generator=g)
        self.y = torch.randint(0, 3, (rows,), generator=g)
        self.tokens = torch.randint(1, 9_000_000, (rows,), generator=g, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.y[i], self.tokens[i]


class TinyModel(torch.nn.Module):
    """Two linear layers and a cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.body = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.head(torch.relu(self.body(batch[0])))

    def loss(self, outputs: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, batch[1])


def rank_layout(rank: int) -> Dict[str, int]:
    """Rank ``r`` uses batches of ``4 + r`` rows and its last batch is ``r`` rows short (uneven)."""
    batch_size = 4 + rank
    return {"batch_size": batch_size, "rows": BATCHES * batch_size - rank}


def expected_global_samples(world_size: int) -> List[int]:
    """Per batch of an epoch: the samples of all ranks together (see `rank_layout`)."""
    samples = []
    for b in range(BATCHES):
        total = 0
        for r in range(world_size):
            layout = rank_layout(r)
            total += min(layout["batch_size"], layout["rows"] - b * layout["batch_size"])
        samples.append(total)
    return samples


def check_exact_counters(results: List[Dict[str, Any]], world_size: int, epochs: int) -> None:
    """Every rank's Timestamp and per-batch global counts equal the plain sums of `train`'s results,
    and the replicas are identical (DDP averaged the same gradients on every rank)."""
    rows = sum(r["local_rows"] for r in results)
    tokens = sum(r["local_tokens"] for r in results)
    assert tokens > 2**24  # beyond what float32 holds exactly, so the piece encoding matters
    per_batch_tokens = [sum(r["local_batch_tokens"][b] for r in results) for b in range(BATCHES)]
    for r in results:
        ts = r["timestamp"]
        assert (ts["epoch"], ts["batch"], ts["sample"], ts["token"]) == (
            epochs,
            epochs * BATCHES,
            epochs * rows,
            epochs * tokens,
        )
        assert r["global_samples"] == expected_global_samples(world_size) * epochs
        assert r["global_tokens"] == per_batch_tokens * epochs
    for r in results[1:]:
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, results[0]["weights"][name], rtol=0, atol=0)


class BatchRecorder(Callback):
    """Per batch: the global sample/token counts the loop agreed on."""

    def __init__(self) -> None:
        self.global_samples: List[int] = []
        self.global_tokens: List[int] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.global_samples.append(state.global_batch_num_samples)
        self.global_tokens.append(state.global_batch_num_tokens)


class SyncGuard(Callback):
    """CUDA: makes any host sync an error from BATCH_START to BATCH_CHECKPOINT: the batch's step, the sum
    of its counters and the Timestamp (the user's token counter runs before, and may read GPU tensors)."""

    def __init__(self) -> None:
        self.batches = 0

    def batch_start(self, state, logger) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def batch_checkpoint(self, state, logger) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self.batches += 1

    def on_exception(self, state, logger, exc) -> None:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def _separate_collective(separate: bool = True) -> Iterator[None]:
    """Trainers built inside sum the counters with their own collective, as before issue 16 (with
    ``separate``); undone on exit, so later jobs of the same process (`run_jobs`) are unaffected."""
    import raytrain_events.trainer.trainer as trainer_module

    wrap = trainer_module.wrap_for_training
    if separate:
        trainer_module.wrap_for_training = lambda trainer, counted: wrap(trainer, False)
    try:
        yield
    finally:
        trainer_module.wrap_for_training = wrap


def train(
    rank: int,
    world_size: int,
    *,
    grad_accum: int = 1,
    epochs: int = 2,
    on_gradients: bool = True,
    tokens: bool = True,
    sync_guard: bool = False,
    device: str = "cpu",
) -> dict:
    """Train `TinyModel` on this rank's uneven shard; return counters, timestamp and weights.

    Without ``tokens`` the batches count no tokens, so every batch but the short last one sends the
    same counters (the path where `BatchCounters` reuses its last encoding and decoding). With
    ``sync_guard`` (CUDA) a host sync inside a batch fails the run."""
    layout = rank_layout(rank)
    data = TokenRows(rank, layout["rows"])
    loader = DataLoader(data, batch_size=layout["batch_size"], shuffle=False)
    recorder = BatchRecorder()
    model = TinyModel()
    with _separate_collective(not on_gradients):  # the separate collective, for comparison
        trainer = Trainer(
            model=model,
            train_dataloader=DataSpec(loader, get_num_tokens_in_batch=(lambda b: int(b[2].sum())) if tokens else None),
            max_duration=f"{epochs}ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            grad_accum=grad_accum,
            callbacks=[recorder, SyncGuard()] if sync_guard else [recorder],
            dist=TorchDist(torch.device(device)),  # the CPU unless asked, also where a GPU is
        )
    on_grads = trainer._counters.on_gradients
    state = trainer.fit()
    return {
        "on_gradients": on_grads,
        "timestamp": state.timestamp.state_dict(),
        "global_samples": recorder.global_samples,
        "global_tokens": recorder.global_tokens,
        "local_tokens": int(data.tokens.sum()),
        "local_rows": len(data),
        "local_batch_tokens": [
            int(data.tokens[i : i + layout["batch_size"]].sum()) for i in range(0, len(data), layout["batch_size"])
        ],
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "device": str(trainer.device),
    }


# --------------------------------------------------------------------- counting collectives
# Counted in the c10d backend, with torch's profiler: gloo records every collective it runs
# ("gloo:all_reduce", "gloo:broadcast"...), whether Python called it or DDP's C++ reducer did.


def _gloo_ops(profile: Any) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for event in profile.events():
        if event.name.startswith("gloo:"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _profiler() -> Any:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


class CollectiveCounter(Callback):
    """Per batch (BEFORE_DATALOADER to BATCH_CHECKPOINT): the collectives the c10d backend ran."""

    def __init__(self) -> None:
        self.per_batch: List[Dict[str, int]] = []
        self._profile: Any = None

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        if event is Event.BEFORE_DATALOADER or event is Event.EPOCH_END:
            if self._profile is not None:  # the epoch's last BEFORE_DATALOADER found no batch
                self._profile.__exit__(None, None, None)
                self._profile = None
            if event is Event.BEFORE_DATALOADER:
                self._profile = _profiler()
                self._profile.__enter__()
        elif event is Event.BATCH_CHECKPOINT and self._profile is not None:
            self._profile.__exit__(None, None, None)
            self.per_batch.append(_gloo_ops(self._profile))
            self._profile = None


def count_collectives(rank: int, world_size: int, *, on_gradients: bool = True) -> dict:
    """Train two epochs while counting collectives per batch; the same for a plain DDP loop."""
    counter = CollectiveCounter()
    layout = rank_layout(rank)
    data = TokenRows(rank, layout["rows"])
    model = TinyModel()
    with _separate_collective(not on_gradients):
        trainer = Trainer(
            model=model,
            train_dataloader=DataSpec(
                DataLoader(data, batch_size=layout["batch_size"]), get_num_tokens_in_batch=lambda b: int(b[2].sum())
            ),
            max_duration="2ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
            callbacks=[counter],
            dist=TorchDist(torch.device("cpu")),
        )
    trainer.fit()
    # The raw thing: a hand-written DDP loop over the same batches.
    plain = TinyModel()
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    plain_per_batch = []
    for _ in range(2):
        for batch in DataLoader(data, batch_size=layout["batch_size"]):
            with _profiler() as profile:
                optimizer.zero_grad(set_to_none=True)
                plain.loss(ddp(batch), batch).backward()
                optimizer.step()
            plain_per_batch.append(_gloo_ops(profile))
    return {"per_batch": counter.per_batch, "plain_per_batch": plain_per_batch}
