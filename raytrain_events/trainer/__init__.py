"""The event-driven training loop (one process; the same code runs inside Ray workers)."""

from raytrain_events.trainer.trainer import Trainer

__all__ = ["Trainer"]
