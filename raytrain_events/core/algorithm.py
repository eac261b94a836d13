"""The `Algorithm` interface: code that changes the training `State` at chosen events.

An algorithm says *when* it runs (`match`) and *what* it does (`apply`); the `Engine` calls
both. This mirrors MosaicML Composer's ``composer.Algorithm`` so Composer algorithms port
unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from raytrain_events.core.event import Event
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = ["Algorithm"]


class Algorithm(ABC):
    """Base class for algorithms.

    Example::

        class ScaleLoss(Algorithm):
            def match(self, event, state):
                return event == Event.AFTER_LOSS

            def apply(self, event, state, logger):
                state.loss = state.loss * 0.5
    """

    @property
    def backwards_create_graph(self) -> bool:
        """True if this algorithm needs a differentiable backward pass (``create_graph=True``)."""
        return False

    @property
    def find_unused_parameters(self) -> bool:
        """True if this algorithm may leave parameters without gradients (DDP must be told)."""
        return False

    @staticmethod
    def required_on_load() -> bool:
        """True if a checkpoint saved with this algorithm can only be loaded with it present."""
        return False

    @abstractmethod
    def match(self, event: Event, state: State) -> bool:
        """Return True if this algorithm should run at ``event`` given ``state``."""

    @abstractmethod
    def apply(self, event: Event, state: State, logger: Logger) -> Optional[int]:
        """Change ``state`` in place; an optional exit code is stored in the `Trace`."""

    def state_dict(self) -> Dict[str, Any]:
        """State to save in checkpoints (tensors and plain Python values only)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        del state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
