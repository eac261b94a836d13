"""examples/predict_ray_data.py: Ray Data `map_batches` with a loaded checkpoint predicts what `Trainer.predict` does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Trainer
from raytrain_events.checkpoint import CheckpointConfig
from tests.example_scripts import load_example

pytestmark = [pytest.mark.ray]


def _example():
    return load_example("predict_ray_data.py", "predict_ray_data")


def test_ray_data_predictions_equal_trainer_predict(ray_cluster, tmp_path):
    example = _example()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x[:, 0] > x[:, 1]).astype(np.int64)
    folder = str(tmp_path / "run" / "checkpoints")
    model = example.build_classifier()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=16),
        max_duration="3ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=1e-2),
        checkpoint=CheckpointConfig(save_folder=folder, save_every_n_seconds=None, save_final=True),
    )
    trainer.fit()
    want = torch.cat(trainer.predict(DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=16)))

    dataset = ray_cluster.data.from_numpy(x).rename_columns({"data": "x"})
    rows = example.predict_dataset(dataset, folder, example.build_classifier, batch_size=32).take_all()
    got = np.stack([row["logits"] for row in rows])
    order = np.argsort([row["x"][0] for row in rows])  # Ray Data may reorder blocks
    np.testing.assert_allclose(got[order], want.numpy()[np.argsort(x[:, 0])], rtol=1e-5, atol=1e-6)
    assert {row["pred"] for row in rows} <= {0, 1}
    # An untrained model predicts something else: the checkpoint's weights were loaded.
    fresh = example.build_classifier()
    assert not np.allclose(fresh.forward((torch.as_tensor(x), None)).detach().numpy(), want.numpy(), atol=1e-3)
