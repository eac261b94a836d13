"""`Shipped`: the worker's run (spec, plan, fault-tolerance side) in Ray's object store, read only by the workers.

Ray Train's controller unpickles ``train_loop_config`` when it starts (it is part of the run's context), though it
never reads it. Passed as it is, the `RunSpec` there names the user's factories and callbacks, and through them
the loop, every algorithm, the checkpointing stack and torch's DTensor, so the controller imported all of it at
every fit before asking for its workers (0.7 s of CPU here with this package alone; a model library in the user's
factories adds its own). Shipped, the controller holds one object reference; each worker reads it once (``get``),
as Ray Train ships the train function itself (``ray.put`` once on the driver).

Per fit: one ``ray.put`` of the run's bytes on the driver; per worker start (restarts and replaced replica
groups included), one ``ray.get`` of them from the object store. The driver holds the reference for the fit.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["Shipped"]


class Shipped:
    """``value`` put in Ray's object store on the driver; `get` reads it where it is used."""

    def __init__(self, value: Dict[str, Any]) -> None:  # noqa: D107
        import ray  # why here: the driver's checks and this module's import stay without Ray

        self.ref = ray.put(value)

    def get(self) -> Dict[str, Any]:
        import ray  # why here: as above

        return ray.get(self.ref)
