"""A `Mixture` on spawned gloo ranks (jobs for `test_gloo_ranks.py`'s spawns: no spawn of their own).

Two ranks of 6 rows and three ranks of 4 rows make the same global batch of 12, so the same
Timestamp, and the plan makes the same global order: a run crashed on 2 ranks resumes on 3.
"""

from __future__ import annotations

import tempfile
from typing import Any, Dict, List, Optional

import torch

from raytrain_events import Callback, DataSpec, Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.core.mixture import Mixture
from raytrain_events.data.mixture_counts import MixtureCounts
from raytrain_events.data.mixture_loader import MixtureLoader
from raytrain_events.dist import TorchDist

SOURCES = {"web": 60, "code": 40, "math": 50}
# 96 samples per epoch, 2 epochs; the second stage starts at sample 115 (epoch 1, inside its second batch).
MIXTURE = Mixture(
    sources=SOURCES,
    stages={"0dur": {"web": 0.5, "code": 0.3, "math": 0.2}, "0.6dur": {"web": 0.2, "code": 0.3, "math": 0.5}},
    epoch_size=96,
)
GLOBAL_BATCH, SEED = 12, 5
# The 2-rank crash's checkpoints, resumed on 3 ranks: made in the test process and passed to the ranks
# as an argument (each rank imports this module afresh).
FOLDER = tempfile.mkdtemp(prefix="mixture-ranks-") + "/checkpoints"
# The same sources with weights an online policy changes at each eval (every 2 batches), from each source's loss.
ONLINE = Mixture(
    sources=SOURCES,
    weights={"web": 0.5, "code": 0.3, "math": 0.2},
    epoch_size=96,
    online={"policy": "exp3", "rate": 4.0},
)
ONLINE_FOLDER = tempfile.mkdtemp(prefix="online-ranks-") + "/checkpoints"


class _Source:
    def __init__(self, source: int, rows: int) -> None:
        self.source, self.rows = source, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, row: int) -> Dict[str, torch.Tensor]:
        x = torch.full((3,), float(self.source * 100 + row) / 100)
        return {"x": x, "id": torch.tensor([self.source, row]), "len": torch.tensor(1 + row % 4)}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(batch["x"])

    def loss(self, outputs: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return (outputs.squeeze(1) - batch["x"][:, 0]).pow(2).mean()

    def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
        import torchmetrics

        return {"loss": torchmetrics.MeanMetric()}

    def update_metric(self, batch: Dict[str, torch.Tensor], outputs: torch.Tensor, metric: Any) -> None:
        metric.update(self.loss(outputs, batch), weight=len(outputs))


class _Seen(Callback):
    def __init__(self, crash_at: Optional[int]) -> None:
        self.batches: List[List[List[int]]] = []
        self.crash_at = crash_at

    def after_dataloader(self, state: Any, logger: Any) -> None:
        self.batches.append(state.batch["id"].tolist())

    def batch_end(self, state: Any, logger: Any) -> None:
        if state.step == self.crash_at:
            raise RuntimeError("simulated crash")


def _held_out(source: int) -> Any:
    """Rows of ``source`` the run does not train on (rows 1000+), each rank evaluating its part of them."""
    from torch.utils.data import DataLoader, DistributedSampler

    rows = [_Source(source, 2000)[1000 + j] for j in range(24)]
    return DataLoader(rows, batch_size=4, sampler=DistributedSampler(rows, shuffle=False))  # type: ignore[arg-type]


def train_mixture(
    rank: int, world_size: int, *, folder: Optional[str] = None, crash_at: Optional[int] = None, online: bool = False
) -> dict:
    """Train the mixture (``online``: `ONLINE`, adapted at each eval) on this rank's part of each global batch;
    its rows per batch, counts, Timestamp and (online) weights history."""
    del rank
    from raytrain_events.data.online_mixture import OnlineMixture
    from raytrain_events.trainer.evaluation import Evaluator

    mixture = ONLINE if online else MIXTURE
    datasets = {name: _Source(i, SOURCES[name]) for i, name in enumerate(mixture.names)}  # ids: the plan's indices
    loader = MixtureLoader(
        mixture, datasets, batch_size=GLOBAL_BATCH // world_size, tokens_of_row=lambda row: int(row["len"])
    )
    evaluators = [
        Evaluator(label=name, dataloader=_held_out(i), eval_interval="2ba") for i, name in enumerate(mixture.names)
    ]
    seen, model = _Seen(crash_at), _Model()
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=loader.tokens_in_batch),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=[seen],
        eval_dataloader=evaluators if online else None,
        dist=TorchDist(torch.device("cpu")),
        seed=SEED,
        checkpoint=CheckpointConfig(save_folder=folder, save_interval="5ba", autoresume=True, async_save=False)
        if folder is not None
        else None,
    )
    started_at = trainer.state.step
    crashed = False
    try:
        trainer.fit()
    except RuntimeError as exc:
        crashed = "simulated crash" in str(exc)
        if not crashed:
            raise
    (counts,) = [c for c in trainer.state.callbacks if isinstance(c, MixtureCounts)]
    policy = [c for c in trainer.state.callbacks if isinstance(c, OnlineMixture)]
    return {
        "history": policy[0].changes() if policy else None,
        "on_gradients": trainer._counters.on_gradients,
        "started_at": started_at,
        "crashed": crashed,
        "batches": seen.batches,
        "counts": counts.counts(),
        "timestamp": trainer.state.timestamp.state_dict(),
    }
