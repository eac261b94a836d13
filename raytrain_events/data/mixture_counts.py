"""`MixtureCounts`: samples and tokens seen per source of a `Mixture`, counted like the global Timestamp.

Each rank's per-source samples and tokens of the batch ride on the loop's one per-batch sum
(registered as counts on ``state.agreement``: no collective of their own), so every rank holds
the run's exact totals. They are logged each batch as ``mixture/samples/<source>`` and, when the
loader counts tokens (``tokens_of_row``), ``mixture/tokens/<source>`` ("tokens seen per source"),
and saved in the checkpoint with the mixture, the seed, the stages' starts and each source's
cursor; a resume restores them and checks them against the plan. A resume may add switch stages
at or after the checkpoint's position (`Mixture.switched`: new weights from there on, each source
continuing from its cursor; how a PBT exploit changes the mixture).
`MixtureLoader` (and `MixtureOrderLoader` on Ray) brings this callback along: users do not add it themselves.
It reads its loader through `CountedLoader` (what both loaders provide), so it imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol

from raytrain_events.core.callback import Callback
from raytrain_events.core.mixture import Mixture
from raytrain_events.core.mixture_plan import MixturePlan

if TYPE_CHECKING:
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = ["CountedLoader", "MixtureCounts", "MixtureResumeError"]


class CountedLoader(Protocol):
    """What `MixtureCounts` reads of the loader it counts for: the local `MixtureLoader` or a Ray worker's
    `MixtureOrderLoader`."""

    mixture: Mixture
    tokens_of_row: Optional[Callable[[Any], int]]
    batch_samples: List[int]  #: this rank's rows of each source in the latest batch
    batch_tokens: List[int]  #: and their tokens (0 without ``tokens_of_row``)

    @property
    def plan(self) -> MixturePlan:
        """The run's order."""
        ...

    def bind(self, *, rank: int, world_size: int, seed: Optional[int], max_duration: Any) -> None:
        """Take the run's rank, world size, seed and length at fit start."""
        ...


class MixtureResumeError(RuntimeError):
    """A checkpoint's mixture or per-source counts do not match this run's."""


class MixtureCounts(Callback):
    """Per-source samples and tokens of a `MixtureLoader`'s run (see the module docstring)."""

    def __init__(self, loader: CountedLoader) -> None:
        self.loader = loader
        names = loader.mixture.names
        self._sample_keys = [f"mixture/samples/{n}" for n in names]
        # Tokens per source only where the loader counts them (``tokens_of_row``): each count is one more
        # value on the per-batch sum, which rides on DDP's gradients up to 16 values (trainer/counters.py).
        counts_tokens = loader.tokens_of_row is not None
        self._token_keys = [f"mixture/tokens/{n}" for n in names] if counts_tokens else []
        self.samples: List[int] = [0] * len(names)
        self.tokens: List[int] = [0] * len(names)
        self._at = (0, 0)  # (epoch, sample in epoch) of the latest batch end or epoch end
        self._saved_cursors: Optional[List[int]] = None  # the loaded checkpoint's cursors
        self._saved_order: Optional[Dict[str, Any]] = None  # the loaded checkpoint's seed and stage starts

    def init(self, state: State, logger: Logger) -> None:
        for key in (*self._sample_keys, *self._token_keys):
            state.agreement.register_count(key)
        self._bind(state)  # a stage the run cannot place fails here, as Trainer(...) is built

    def _bind(self, state: State) -> None:
        self.loader.bind(rank=state.rank, world_size=state.world_size, seed=state.seed, max_duration=state.max_duration)

    def fit_start(self, state: State, logger: Logger) -> None:
        loader = self.loader
        self._bind(state)  # again: fit(duration=...) may have changed the run's length
        logger.log_hyperparameters({"mixture": loader.mixture.to_dict(), "mixture_plan": loader.plan.describe()})
        self._at = (state.epoch, int(state.timestamp.sample_in_epoch))
        saved, self._saved_cursors = self._saved_cursors, None
        order, self._saved_order = self._saved_order, None
        if order is not None and not self._continues(order):
            raise MixtureResumeError(
                f"The checkpoint's mixture order has seed {order['seed']} and stages starting at samples "
                f"{order['stage_starts']}; this run's has seed {loader.plan.seed} and {list(loader.plan.starts)}: "
                "resume with the checkpoint's seed (and, under 'dur' stages, its max_duration)."
            )
        if saved is not None and saved != list(loader.plan.cursors(*self._at)):
            names = loader.mixture.names
            raise MixtureResumeError(
                f"The checkpoint's per-source cursors {dict(zip(names, saved))} differ from this run's plan at its "
                f"position ({dict(zip(names, loader.plan.cursors(*self._at)))}): the data order changed (another "
                "seed, or another max_duration under 'dur' stages). Resume with the checkpoint's ones."
            )

    def after_dataloader(self, state: State, logger: Logger) -> None:
        agreement, loader = state.agreement, self.loader
        for key, value in zip(self._sample_keys, loader.batch_samples):
            agreement.set_count(key, value)
        for key, value in zip(self._token_keys, loader.batch_tokens):
            agreement.set_count(key, value)

    def batch_end(self, state: State, logger: Logger) -> None:
        agreement, metrics = state.agreement, {}
        for i, key in enumerate(self._sample_keys):
            self.samples[i] += agreement.total(key)
            metrics[key] = self.samples[i]
        for i, key in enumerate(self._token_keys):
            self.tokens[i] += agreement.total(key)
            metrics[key] = self.tokens[i]
        self._at = (state.epoch, int(state.timestamp.sample_in_epoch))
        logger.log_metrics(metrics, step=int(state.timestamp.batch))

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._at = (state.epoch, 0)

    def counts(self) -> Dict[str, Dict[str, int]]:
        """``{source: {"samples": n, "tokens": n}}`` so far (the same on every rank)."""
        return {
            name: {"samples": s, "tokens": t}
            for name, s, t in zip(self.loader.mixture.names, self.samples, self.tokens)
        }

    def state_dict(self) -> Dict[str, Any]:
        epoch, position = self._at
        return {
            "mixture": self.loader.mixture.to_dict(),
            **self._order(),
            "samples": list(self.samples),
            "tokens": list(self.tokens),
            "epoch": epoch,
            "sample_in_epoch": position,
            "cursors": list(self.loader.plan.cursors(epoch, min(position, self.loader.plan.epoch_size))),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = Mixture.from_dict(state["mixture"])
        if saved != self.loader.mixture and not self.loader.mixture.continues(saved):
            raise MixtureResumeError(
                f"The checkpoint was trained on another mixture ({saved.to_dict()}) than this run's "
                f"({self.loader.mixture.to_dict()}): resume with the checkpoint's mixture, change the weights from "
                "the checkpoint on with mixture.switched(at_sample, weights), or start a new run (load_from with "
                "the model only)."
            )
        self.samples, self.tokens = list(state["samples"]), list(state["tokens"])
        self._saved_cursors = list(state["cursors"])
        self._saved_order = {"seed": state["seed"], "stage_starts": list(state["stage_starts"])}

    def on_rollback(self, state: State, logger: Logger) -> None:
        """The counts were restored mid-fit (a rollback, not a resume): no checkpoint order to check at the next fit."""
        self._saved_cursors = self._saved_order = None

    def _continues(self, order: Dict[str, Any]) -> bool:
        """The checkpoint's order is this run's, or this run's adds switch stages at or after its position."""
        mine, saved = self._order(), list(order["stage_starts"])
        starts = mine["stage_starts"]
        at = self._at[0] * self.loader.plan.epoch_size + self._at[1]  # the checkpoint's global sample
        return (
            order["seed"] == mine["seed"]
            and starts[: len(saved)] == saved
            and all(start >= at for start in starts[len(saved) :])
        )

    def _order(self) -> Dict[str, Any]:
        """What fixes the plan besides the mixture: the seed and the stages' starts in samples."""
        return {"seed": self.loader.plan.seed, "stage_starts": list(self.loader.plan.starts)}
