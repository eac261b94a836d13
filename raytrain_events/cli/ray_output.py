"""Keep a Ray run's console readable: the driver's progress bar and the job's own lines.

``quiet_ray_data()`` turns off Ray Data's per-dataset progress bars (Ray Train copies the
driver's ``DataContext`` to the workers, so call it on the driver before ``fit``).
``quiet_worker_logs`` is a callbacks factory for `RayTrainer` (``callbacks=quiet_worker_logs``):
it adds no callback but lowers Ray Train's per-report INFO line on each worker to WARNING.
"""

from __future__ import annotations

import logging
from typing import Any, List

__all__ = ["quiet_ray_data", "quiet_worker_logs"]


def quiet_ray_data() -> None:
    from ray.data import DataContext

    context = DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False


def quiet_worker_logs(*_: Any) -> List[Any]:
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # pragma: no cover - other Ray versions
        return []
    logging.getLogger(context.__file__).setLevel(logging.WARNING)
    return []
