"""The event-driven training loop (one process; the same code runs inside Ray workers)."""

from raytrain_events.trainer.evaluation import Evaluator
from raytrain_events.trainer.options import LoopOptions
from raytrain_events.trainer.seed import seed_everything
from raytrain_events.trainer.trainer import Trainer

__all__ = ["Evaluator", "LoopOptions", "Trainer", "seed_everything"]
