"""Spawned gloo ranks (no Ray) running `Trainer` with `TorchDist`: helpers for tests/trainer.

`run_ranks(fn, world_size, **kwargs)` starts ``world_size`` processes with
``torch.multiprocessing.spawn``, forms a gloo process group on 127.0.0.1, runs
``fn(rank, world_size, **kwargs)`` in each and returns the ranks' results in rank order.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

from raytrain_events import Callback, DataSpec, Event, Trainer
from raytrain_events.dist import TorchDist

BATCHES = 5  # batches per epoch, the same on every rank (DDP needs it); sizes differ per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], kwargs: Dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # the child's own environment
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result: Any = fn(rank, world_size, **kwargs)
    except BaseException:
        result = {"error": traceback.format_exc()}
    finally:
        tdist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> List[Any]:
    """Run ``fn`` on ``world_size`` spawned gloo ranks; re-raise the first rank's error."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world_size, _free_port(), out_dir, fn, kwargs), nprocs=world_size, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
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


class BatchRecorder(Callback):
    """Per batch: the global sample/token counts the loop agreed on."""

    def __init__(self) -> None:
        self.global_samples: List[int] = []
        self.global_tokens: List[int] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.global_samples.append(state.global_batch_num_samples)
        self.global_tokens.append(state.global_batch_num_tokens)


def train(rank: int, world_size: int, *, grad_accum: int = 1, epochs: int = 2, on_gradients: bool = True) -> dict:
    """Train `TinyModel` on this rank's uneven shard; return counters, timestamp and weights."""
    layout = rank_layout(rank)
    data = TokenRows(rank, layout["rows"])
    loader = DataLoader(data, batch_size=layout["batch_size"], shuffle=False)
    recorder = BatchRecorder()
    model = TinyModel()
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=lambda b: int(b[2].sum())),
        max_duration=f"{epochs}ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        grad_accum=grad_accum,
        callbacks=[recorder],
        dist=TorchDist(),
    )
    if not on_gradients:  # today's separate collective, for comparison
        trainer._counters.on_gradients = False
    used_hook = trainer._counters.on_gradients
    state = trainer.fit()
    return {
        "used_hook": used_hook,
        "timestamp": state.timestamp.state_dict(),
        "global_samples": recorder.global_samples,
        "global_tokens": recorder.global_tokens,
        "local_tokens": int(data.tokens.sum()),
        "local_rows": len(data),
        "local_batch_tokens": [
            int(data.tokens[i : i + layout["batch_size"]].sum()) for i in range(0, len(data), layout["batch_size"])
        ],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


# --------------------------------------------------------------------- counting collectives
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
)


def _from_ddp_comm_hook() -> bool:
    """True if the caller is the loop's DDP communication hook (DDP's gradient all-reduce)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_hook" and frame.f_code.co_filename.endswith(
            os.path.join("trainer", "counters.py")
        ):
            return True
        frame = frame.f_back
    return False


class CollectiveCounter(Callback):
    """Wraps torch.distributed's collectives; per batch, counts DDP's (from its hook) and all others."""

    def __init__(self) -> None:
        self.per_batch: List[Dict[str, int]] = []
        self._current: Dict[str, int] = {}
        self._counting = False
        for name in _COLLECTIVES:
            original = getattr(tdist, name)
            setattr(tdist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self._counting:
                key = "ddp" if _from_ddp_comm_hook() else name
                self._current[key] = self._current.get(key, 0) + 1
            return original(*args, **kwargs)

        return wrapped

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        # From the batch's first event to its last: the counter sum starts right after AFTER_DATALOADER.
        if event is Event.BEFORE_DATALOADER:
            self._current, self._counting = {}, True
        elif event is Event.BATCH_CHECKPOINT and self._counting:
            self.per_batch.append(self._current)
            self._counting = False


def count_collectives(rank: int, world_size: int, *, on_gradients: bool = True) -> dict:
    """Train two epochs while counting collectives per batch."""
    counter = CollectiveCounter()
    layout = rank_layout(rank)
    data = TokenRows(rank, layout["rows"])
    model = TinyModel()
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(
            DataLoader(data, batch_size=layout["batch_size"]), get_num_tokens_in_batch=lambda b: int(b[2].sum())
        ),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.05),
        callbacks=[counter],
        dist=TorchDist(),
    )
    if not on_gradients:
        trainer._counters.on_gradients = False
    trainer.fit()
    return {"per_batch": counter.per_batch}
