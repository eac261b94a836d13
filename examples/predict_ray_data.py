"""Batch prediction with Ray Data: a trained checkpoint, `Dataset.map_batches`, one model per actor.

    python examples/predict_ray_data.py            # trains a small classifier, then predicts on Ray Data

`predict_dataset` is the reusable part: each Ray Data actor loads the newest committed checkpoint
in ``checkpoint_folder`` once (any fsspec URL: a local folder or ``s3://...`` with
``storage_options``), then maps numpy batches to predictions. Ray Data streams the dataset through
the actors, so the data never has to fit on one machine; the model never travels from the driver
(each actor builds it from ``build_model`` and the checkpoint's weights).

In one process, `Trainer.predict(dataloader)` does the same with the PREDICT_* events.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from raytrain_events.checkpoint import load_latest_valid
from raytrain_events.storage.run_dir import STATE_FILE


class CheckpointPredictor:
    """A Ray Data callable class: loads the model once, then ``batch["x"] -> batch + {"logits", "pred"}``."""

    def __init__(
        self,
        checkpoint_folder: str,
        build_model: Callable[[], torch.nn.Module],
        storage_options: Optional[Dict[str, Any]] = None,
        input_column: str = "x",
    ) -> None:
        loaded = load_latest_valid(checkpoint_folder, storage_options=storage_options, files=[STATE_FILE])
        if loaded is None:
            raise FileNotFoundError(f"No committed checkpoint in {checkpoint_folder!r}: train with a CheckpointConfig.")
        self.model = build_model()
        self.model.load_state_dict(loaded.files[STATE_FILE]["model"])
        self.model.eval()
        self.input_column = input_column

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        with torch.no_grad():
            logits = self.model.forward((torch.as_tensor(batch[self.input_column]), None))
        return {**batch, "logits": logits.numpy(), "pred": logits.argmax(1).numpy()}


def predict_dataset(
    dataset: Any,
    checkpoint_folder: str,
    build_model: Callable[[], torch.nn.Module],
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    batch_size: int = 256,
    concurrency: int = 1,
) -> Any:
    """``dataset`` with ``logits`` and ``pred`` columns, computed by ``concurrency`` actors (lazy, a Ray Dataset)."""
    return dataset.map_batches(
        CheckpointPredictor,
        fn_constructor_kwargs={
            "checkpoint_folder": checkpoint_folder,
            "build_model": build_model,
            "storage_options": storage_options,
        },
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=concurrency,
    )


def build_classifier() -> torch.nn.Module:
    """The example's model (the same function trains and predicts)."""
    from raytrain_events.models import ClassifierModel

    net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    return ClassifierModel(net, num_classes=2)


def _train(folder: str, x: np.ndarray, y: np.ndarray) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from raytrain_events import Trainer
    from raytrain_events.checkpoint import CheckpointConfig

    model = build_classifier()
    Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=32, shuffle=True),
        max_duration="5ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=1e-2),
        checkpoint=CheckpointConfig(save_folder=folder, save_every_n_seconds=None, save_final=True),
        seed=0,
    ).fit()


def main() -> None:
    import ray

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    y = (x[:, 0] > x[:, 1]).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/run/checkpoints"
        _train(folder, x, y)
        ray.init(include_dashboard=False)
        predicted = predict_dataset(ray.data.from_numpy(x).rename_columns({"data": "x"}), folder, build_classifier)
        pred = np.concatenate([b["pred"] for b in predicted.iter_batches(batch_format="numpy")])
        print(f"accuracy of the loaded checkpoint on Ray Data: {(pred == y).mean():.3f}")
        ray.shutdown()


if __name__ == "__main__":
    main()
