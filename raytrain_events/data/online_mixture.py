"""`OnlineMixture`: a `Mixture`'s weights changed during the run by its ``online=`` policy, every change exact.

`MixtureLoader` brings it along for a mixture with ``online={...}`` (users do not add it). At each
eval where every source's evaluator ran (``Evaluator(label=<source>)``, or ``online["evaluators"]``),
it reads each source's loss metric (computed and synchronized across ranks by the eval itself:
no collective of its own), asks the policy (`raytrain_events.core.mixture_online.next_weights`) for
new weights, and switches the loader to its mixture with a switch stage at the next global batch's
first position (`Mixture.switched`): every rank makes the same decision at the same batch. The
policy ``"target"`` also waits for its target's evaluator (``online["target"]``) and reads its loss
the same way. Each change (`WeightsChange`: position, batch, old and new weights, the losses) is logged
(``mixture/weight/<source>`` every batch, which the run report plots) and checkpointed; a resume
(or a `SpikeGuard` rollback) replays the saved history onto the loader's mixture, so the order,
the per-source counts (`MixtureCounts`, loaded after this) and the ledger of the checkpoint
(which holds the mixture with its switch stages) stay exact.

Cost: per decision, one read of each source's computed metric and one `Mixture.switched`
(O(changes so far) to check the stages); per batch, one log call of K floats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Tuple

from raytrain_events.core.callback import Callback
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.mixture_online import (
    LOSS_DIGITS,
    OnlinePolicy,
    WeightsChange,
    apply_history,
    initial_logs,
    next_weights,
)
from raytrain_events.core.mixture_plan import MixturePlan

if TYPE_CHECKING:
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = ["OnlineMixture", "SwitchableLoader"]


class SwitchableLoader(Protocol):
    """What `OnlineMixture` reads and calls of its loader (the local `MixtureLoader`), so it imports none."""

    mixture: Mixture

    @property
    def plan(self) -> MixturePlan:
        """The run's order."""
        ...

    @property
    def total_samples(self) -> Optional[int]:
        """The run's samples (for 'dur' stages)."""
        ...

    def switch(self, mixture: Mixture) -> None:
        """Train on ``mixture`` (this one with switch stages added) from the next batch on."""
        ...


class OnlineMixture(Callback):
    """The ``online=`` policy of a `MixtureLoader`'s mixture (see the module docstring)."""

    def __init__(self, loader: SwitchableLoader) -> None:
        mixture = loader.mixture
        assert mixture.online is not None
        self.loader = loader
        self.base = mixture  # the user's mixture: the history's switches are added to it
        self.names = mixture.names
        self.policy = OnlinePolicy.from_dict(mixture.online, self.names)
        first = mixture.stage_list[0][1]
        self.start = [float(amount) for _, amount in first]
        self.history: List[WeightsChange] = []
        self._logs = initial_logs(self.start)
        self._seen: Dict[str, Any] = {}  # label -> the metrics dict of its latest eval already used
        self._fitting = False
        self._weight_keys = [f"mixture/weight/{n}" for n in self.names]

    @property
    def weights(self) -> List[float]:
        """The proportions trained now (the latest change's, else the first stage's, normalised)."""
        if self.history:
            return list(self.history[-1].new)
        total = sum(self.start)
        return [w / total for w in self.start]

    def fit_start(self, state: State, logger: Logger) -> None:
        labels = {e.label: e for e in state.evaluators}
        target = self.policy.target
        if target is not None and target not in labels:
            raise MixtureError(
                f"The mixture's online policy 'target' reads the loss of the task the run is for, but no evaluator is "
                f"labelled {target!r} (evaluators: {sorted(labels)}). Fix: eval_dataloader=[..., Evaluator(label="
                f"{target!r}, dataloader=<that task's held-out rows>)], or name its label in online={{'target': ...}}."
            )
        missing = [(n, self.policy.label(n)) for n in self.names if self.policy.label(n) not in labels]
        if missing:
            raise MixtureError(
                f"The mixture's online policy reads each source's eval loss, but no evaluator is labelled "
                f"{[label for _, label in missing]} (sources {[n for n, _ in missing]}; evaluators: {sorted(labels)}). "
                "Fix: eval_dataloader=[Evaluator(label=<source>, dataloader=<that source's held-out rows>), ...], "
                "or online={'evaluators': {source: label}}."
            )
        self._fitting = True
        self._seen = {label: state.eval_metrics.get(label) for label in labels}  # only evals from now on count
        logger.log_metrics(dict(zip(self._weight_keys, self.weights)), step=int(state.timestamp.batch))

    def fit_end(self, state: State, logger: Logger) -> None:
        self._fitting = False

    def batch_end(self, state: State, logger: Logger) -> None:
        logger.log_metrics(dict(zip(self._weight_keys, self.weights)), step=int(state.timestamp.batch))

    def eval_end(self, state: State, logger: Logger) -> None:
        if not self._fitting:
            return  # Trainer.eval() outside fit: nothing to adapt
        labels = self.policy.labels(self.names)  # the sources', then the target's (policy 'target')
        fresh = [state.eval_metrics.get(label) for label in labels]
        if any(m is None or m is self._seen.get(label) for m, label in zip(fresh, labels)):
            return  # not every source (and the target) evaluated since the last decision
        for label, metrics in zip(labels, fresh):
            self._seen[label] = metrics
        losses = [self._loss(label, metrics) for label, metrics in zip(labels, fresh)]  # type: ignore[arg-type]
        k = len(self.names)
        self._decide(state, logger, losses[:k], losses[k] if len(losses) > k else None)

    def _loss(self, label: str, metrics: Dict[str, Any]) -> float:
        name = self.policy.metric
        if name is None:
            if len(metrics) != 1:
                raise MixtureError(
                    f"Evaluator {label!r} computes {sorted(metrics)}: name the loss the online policy reads, "
                    "online={'metric': '<name>'}."
                )
            name = next(iter(metrics))
        if name not in metrics:
            raise MixtureError(f"Evaluator {label!r} has no metric {name!r} (its metrics: {sorted(metrics)}).")
        return round(float(metrics[name].compute()), LOSS_DIGITS)  # computed (and synchronized) by the eval

    def _decide(self, state: State, logger: Logger, losses: List[float], target: Optional[float]) -> None:
        plan = self.loader.plan
        position = int(state.timestamp.epoch) * plan.epoch_size + int(state.timestamp.sample_in_epoch)
        total = self.loader.total_samples
        if position <= plan.starts[-1] or (total is not None and position >= total):
            return  # at the start, at the run's end, or twice at one position (a batch eval, then the epoch's)
        logs, new = next_weights(self.policy, self._logs, losses, target=target, past=self._past(self.history))
        batch = int(state.timestamp.batch)
        change = WeightsChange(position, batch, tuple(self.weights), tuple(new), tuple(losses), target)
        self.loader.switch(self.loader.mixture.switched(position, dict(zip(self.names, new))))
        self._logs = logs
        self.history.append(change)
        logger.log_metrics(dict(zip(self._weight_keys, new)), step=int(state.timestamp.batch))

    @staticmethod
    def _past(history: List[WeightsChange]) -> List[Tuple[Tuple[float, ...], Optional[float]]]:
        """The earlier decisions' (losses, target loss): what the policy 'target' fits."""
        return [(change.losses, change.target) for change in history]

    def changes(self) -> List[Dict[str, Any]]:
        """The weights history as plain data: ``[{position, batch, old, new, losses}, ...]``."""
        return [change.to_dict(self.names) for change in self.history]

    def state_dict(self) -> Dict[str, Any]:
        return {"policy": self.policy.to_dict(), "history": self.changes()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["policy"] != self.policy.to_dict():
            raise MixtureError(
                f"The checkpoint's weights were chosen by online={state['policy']}, this run's mixture has "
                f"online={self.policy.to_dict()}: resume with the checkpoint's policy."
            )
        history = [WeightsChange.from_dict(change, self.names) for change in state["history"]]
        logs = initial_logs(self.start)
        for i, change in enumerate(history):  # the policy's state is a pure function of the decisions' losses
            logs, _ = next_weights(self.policy, logs, change.losses, target=change.target, past=self._past(history[:i]))
        self.history, self._logs = history, logs
        self.loader.switch(apply_history(self.base, history))

    def on_rollback(self, state: State, logger: Logger) -> None:
        self._seen = {label: state.eval_metrics.get(label) for label in self._seen}
