"""What the bad-input tests share: a fixture that fails the test if Ray starts, and good `RayTrainer` arguments.

`no_ray` patches every way this package starts or joins Ray (``ray.init``, `cluster.ensure_ray`)
to raise, so a test proves its refusal came before Ray; `ray_kwargs` is a good run to change one
argument of; `parquet_source` writes a small Parquet file and opens it as a `ParquetRowGroups`.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from raytrain_events.models import ClassifierModel


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything starts (or connects to) Ray."""
    import ray

    import raytrain_events.ray.cluster as cluster

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Ray was started: the bad input should have been refused before")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(cluster, "ensure_ray", refuse)
    was_initialized = ray.is_initialized()
    yield
    assert ray.is_initialized() == was_initialized


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)


def unread_dataset() -> Any:
    """A `ray.data.Dataset` object (what the driver checks), made without Ray: these runs never read it."""
    import ray.data

    class UnreadDataset(ray.data.Dataset):
        def __init__(self) -> None:
            pass

        def __del__(self) -> None:
            pass

    return UnreadDataset()


def ray_kwargs(**over: Any) -> Dict[str, Any]:
    """Good `RayTrainer` arguments (an unread train set, one epoch) with ``over`` applied."""
    kwargs: Dict[str, Any] = dict(
        model=lambda: ClassifierModel(Net(), num_classes=3),
        optimizers=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        datasets={"train": unread_dataset()},
        max_duration="1ep",
        run_name="bad-input",
    )
    kwargs.update(over)
    return kwargs


def parquet_source(path: str, rows: int, **columns: Any) -> Any:
    """``ParquetRowGroups`` over a new file of ``rows`` rows: ``id``, ``x`` (4 floats) and ``columns``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    table = {"id": list(range(rows)), "x": [[1.0] * 4] * rows, **{k: v(rows) for k, v in columns.items()}}
    pq.write_table(pa.table(table), path)
    return ParquetRowGroups(path)
