"""`State`: everything the loop tracks, what algorithms change, and what checkpoints save.

Fields follow Composer's ``State``. ``state.model`` is always the user's module (never the DDP
wrapper), so algorithms and checkpoints see the real parameter names.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from raytrain_events.core.agreement import Agreement
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.callback import Callback
from raytrain_events.core.precision import Precision
from raytrain_events.core.spikes import Skipped
from raytrain_events.core.time import Time, Timestamp, TimeUnit, ensure_time

__all__ = ["State", "CheckpointMismatchError", "model_mismatch", "drop_ignored_keys"]


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model or run it is being loaded into."""


def _as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class State:
    """The state of a training run.

    Example::

        state = State(model=model, max_duration="2ep", optimizers=opt)
        state.timestamp = state.timestamp.to_next_batch(samples=64)
        state.get_elapsed_duration()   # Time(0.0..., TimeUnit.DURATION)
    """

    def __init__(
        self,
        *,
        model: Any,
        max_duration: Union[str, Time[Any], int, None] = None,
        train_dataloader: Any = None,
        evaluators: Sequence[Any] = (),
        grad_accum: int = 1,
        precision: Union[str, Precision] = Precision.FP32,
        optimizers: Any = None,
        schedulers: Any = None,
        scaler: Any = None,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        steps_per_epoch: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        run_name: str = "run",
        seed: Optional[int] = None,
        count_tokens: Optional[Callable[[Any], int]] = None,
        device_transforms: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self.model = model
        # The loop's token counter of a train batch (the DataSpec's get_num_tokens_in_batch; None: no tokens
        # counted), for a callback that must count a part of a batch the same way (SpikeGuard's quarantined rows).
        self.count_tokens = count_tokens
        # The train DataSpec's device_transforms (the loader's, then the user's; None: none), for code that reads
        # the train data itself and must see the batches the model sees (SWA's BatchNorm pass).
        self.device_transforms = device_transforms
        self.max_duration = None if max_duration is None else ensure_time(max_duration, TimeUnit.EPOCH)
        self.train_dataloader = train_dataloader
        self.evaluators = list(evaluators)
        self.grad_accum = grad_accum
        # grad_accum="auto": the loop doubles grad_accum on a device OOM, and a resume reuses the saved value.
        self.auto_microbatching = False
        self.precision = Precision.parse(precision)
        self.optimizers = _as_list(optimizers)
        self.schedulers = _as_list(schedulers)
        self.scaler = scaler
        self.algorithms: List[Algorithm] = list(algorithms)
        self.callbacks: List[Callback] = list(callbacks)
        self.timestamp = Timestamp()
        self.skipped = Skipped()  # positions not trained (rolled-back windows, quarantined rows): core/spikes.py
        self.batch: Any = None
        self.batch_num_samples = 0
        self.batch_num_tokens = 0
        self.global_batch_num_samples = 0
        self.global_batch_num_tokens = 0
        self.loss: Any = None
        self.outputs: Any = None
        self.eval_metrics: Dict[str, Dict[str, Any]] = {}
        self.train_metrics: Dict[str, Any] = {}
        self.rank = rank
        self.world_size = world_size
        self.run_name = run_name
        self.seed = seed
        self._steps_per_epoch = steps_per_epoch
        self.stop_requested = False
        self.stop_consistent = False
        self.stop_reason: Optional[str] = None
        # Flags a component asks for on one rank and all ranks agree on at the same batch
        # (a checkpoint on a timer or SIGTERM, a report to the driver): see `Agreement`.
        self.agreement = Agreement()

    # ----------------------------------------------------------------- time
    @property
    def epoch(self) -> int:
        """Epochs completed so far."""
        return self.timestamp.get_value(TimeUnit.EPOCH)

    @property
    def step(self) -> int:
        """Optimizer steps (batches) completed so far, counted globally."""
        return self.timestamp.get_value(TimeUnit.BATCH)

    @property
    def batch_idx(self) -> int:
        """Index of the current batch within the epoch."""
        index: int = self.timestamp.batch_in_epoch.value
        return index

    @property
    def max_epochs(self) -> Time[Any]:
        """``max_duration`` in epochs (only defined when it is given in epochs)."""
        if self.max_duration is None or self.max_duration.unit != TimeUnit.EPOCH:
            raise ValueError(f"max_epochs is only defined when max_duration is in epochs, not {self.max_duration!r}.")
        return self.max_duration

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Batches per epoch: set explicitly, else the dataloader's length if it has one."""
        if self._steps_per_epoch is not None:
            return self._steps_per_epoch
        loader = getattr(self.train_dataloader, "dataloader", self.train_dataloader)
        try:
            return len(loader)
        except TypeError:
            return None

    @steps_per_epoch.setter
    def steps_per_epoch(self, value: Optional[int]) -> None:
        self._steps_per_epoch = value

    def get_elapsed_duration(self) -> Time[Any]:
        """Fraction of ``max_duration`` completed, as a `Time` in DURATION."""
        if self.max_duration is None:
            raise ValueError("get_elapsed_duration() needs max_duration to be set.")
        unit = self.max_duration.unit
        elapsed = self.timestamp.get_value(unit)
        return Time(elapsed / self.max_duration.value, TimeUnit.DURATION)

    def stop_training(self, reason: str = "requested", *, consistent: bool = False) -> None:
        """Ask the loop to stop after the current batch (or epoch).

        With several ranks, a stop asked on one rank is agreed by all through the next batch's
        count collective, so all ranks stop at the same batch. Pass ``consistent=True`` when
        every rank makes the same call at the same batch (for example from synchronized eval
        metrics): the loop then stops right after this batch without waiting.
        """
        self.stop_requested = True
        self.stop_consistent = self.stop_consistent or consistent or self.world_size == 1
        self.stop_reason = reason

    def request(self, flag: str) -> None:
        """Ask on this rank for ``flag`` (registered with ``state.agreement.register``); see `agreed`."""
        self.agreement.request(flag)

    def agreed(self, flag: str) -> bool:
        """True if any rank asked for ``flag`` before this batch's collective: the same on every rank."""
        return self.agreement.agreed(flag)

    # ---------------------------------------------------------------- batch
    @property
    def batch_pair(self) -> Any:
        """The batch as an ``(inputs, targets)`` pair; TypeError for other batch types."""
        batch = self.batch
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch
        raise TypeError(
            f"state.batch is a {type(batch).__name__}, not an (inputs, targets) pair; use state.batch directly."
        )

    @property
    def batch_dict(self) -> Mapping[str, Any]:
        """The batch as a mapping; TypeError for other batch types."""
        if isinstance(self.batch, Mapping):
            return self.batch
        raise TypeError(
            f"state.batch is a {type(self.batch).__name__}, not a dict; use state.batch_pair or state.batch."
        )

    # -------------------------------------------------------- serialization
    def state_dict(self, exclude_callbacks: Collection[str] = (), position: bool = True) -> Dict[str, Any]:
        """Everything a checkpoint needs to resume this run (tensors and plain values only).

        ``exclude_callbacks``: checkpoint keys of callbacks whose state is left out, never computed (a host snapshot
        leaves out its taker's own bookkeeping, which may be large: `SpikeGuard`'s quarantine). ``position=False``:
        without the Timestamp and ``skipped`` (a host snapshot keeps both through a restore: never computed)."""
        algorithms = _keyed(self.algorithms)
        out: Dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [sched.state_dict() for sched in self.schedulers],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "algorithms": {k: a.state_dict() for k, a in algorithms.items()},
            "algorithms_required": [k for k, a in algorithms.items() if a.required_on_load()],
            "callbacks": {k: c.state_dict() for k, c in _keyed(self.callbacks).items() if k not in exclude_callbacks},
        }
        if position:
            out["timestamp"] = self.timestamp.state_dict()
            out["skipped"] = self.skipped.state_dict()
        out["run_name"], out["seed"], out["grad_accum"] = self.run_name, self.seed, self.grad_accum
        return out

    def load_model_state(
        self, state_dict: Mapping[str, Any], strict: bool = True, ignored: Collection[str] = ()
    ) -> None:
        """Load model weights; a checkpoint of another model raises `CheckpointMismatchError`.

        ``ignored`` model keys (see `drop_ignored_keys`) keep their current values and are not checked.
        """
        model_sd = self.model.state_dict()
        saved: Dict[str, Optional[Tuple[int, ...]]] = {
            k: tuple(v.shape) if hasattr(v, "shape") else None for k, v in state_dict.items()
        }
        shapes = {k: tuple(v.shape) for k, v in model_sd.items() if k not in ignored}
        problem = model_mismatch(shapes, saved, strict)
        if problem:
            raise CheckpointMismatchError(
                f"The checkpoint does not match this model ({problem}). {mismatch_fix(problem)}"
            )
        self.model.load_state_dict(state_dict, strict=strict and not ignored)  # the rest was checked above

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = False, ignored: Collection[str] = ()) -> None:
        """Restore what `state_dict` produced (model, optimizers, schedulers, timestamp, ...).

        A sharded checkpoint restores model and optimizers itself and passes the rest without them.
        """
        # Check what can be checked before changing anything, so a refused load leaves the run intact.
        keys = _keyed(self.algorithms)
        missing_required = [k for k in state.get("algorithms_required", []) if k not in keys]
        if missing_required:
            raise CheckpointMismatchError(
                f"The checkpoint was saved with algorithms {missing_required} that must be present to load it "
                "(required_on_load); add them to `algorithms`."
            )
        check_optimizer_states(self.optimizers, state.get("optimizers", ()))
        if "model" in state:
            self.load_model_state(state["model"], strict=strict, ignored=ignored)
        if "optimizers" in state:
            _load_list("optimizers", self.optimizers, state["optimizers"])
        if "schedulers" in state:
            _load_list("schedulers", self.schedulers, state["schedulers"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        for key, algorithm_state in state.get("algorithms", {}).items():
            if key in keys:
                keys[key].load_state_dict(algorithm_state)
        callbacks = _keyed(self.callbacks)
        for key, callback_state in state.get("callbacks", {}).items():
            if key in callbacks:
                callbacks[key].load_state_dict(callback_state)
        if "timestamp" in state:
            self.timestamp = Timestamp.from_state_dict(state["timestamp"])
            self.skipped = Skipped.from_state_dict(state.get("skipped", {}))  # none before the record: zeros
        if self.auto_microbatching and state.get("grad_accum") is not None:
            self.grad_accum = int(state["grad_accum"])  # the value auto microbatching found, not 1 again


def model_mismatch(
    model_shapes: Mapping[str, Tuple[int, ...]], saved_shapes: Mapping[str, Optional[Tuple[int, ...]]], strict: bool
) -> Optional[str]:
    """Why a checkpoint's model keys/shapes do not fit the model, or None (shared by full and sharded loads).

    Shape mismatches always count; missing/unexpected keys count when ``strict``, or when the checkpoint
    shares no key with the model (it would load nothing).
    """
    mismatched = [
        f"{k}: checkpoint {shape} vs model {model_shapes[k]}"
        for k, shape in saved_shapes.items()
        if k in model_shapes and shape is not None and tuple(shape) != tuple(model_shapes[k])
    ]
    missing = sorted(set(model_shapes) - set(saved_shapes))
    unexpected = sorted(set(saved_shapes) - set(model_shapes))
    keys_count = strict or (bool(model_shapes) and len(missing) == len(model_shapes))
    parts = []
    if mismatched:
        parts.append("shape mismatch: " + "; ".join(mismatched[:10]))
    if keys_count and missing:
        parts.append(f"missing in checkpoint: {missing[:10]}")
    if keys_count and unexpected:
        parts.append(f"not in model: {unexpected[:10]}")
    return " | ".join(parts) or None


def mismatch_fix(problem: str) -> str:
    """The fix for a `model_mismatch` ``problem``: ``load_strict=False`` helps with keys, never with shapes."""
    if "shape mismatch" in problem:
        return (
            "Fix: load it into the architecture it was saved from (the same sizes); to start a changed part "
            "fresh (e.g. a new head), skip its entries with load_ignore_keys=['model/<name>*'] and "
            "load_weights_only=True. load_strict=False does not help: it ignores missing/unexpected keys, "
            "never other shapes."
        )
    return "Fix: check that it was saved from the same architecture; pass load_strict=False to ignore missing/unexpected keys."


def check_optimizer_states(optimizers: Sequence[Any], states: Sequence[Any]) -> None:
    """Refuse optimizer states saved by another kind of optimizer (SGD's into Adam: torch's KeyError 'betas')."""
    for optimizer, saved in zip(optimizers, states):
        groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
        if not groups or not getattr(optimizer, "param_groups", None):
            continue
        # Hyperparameters only (numbers, tuples): flags a newer torch added (None/bool) are defaulted on load.
        group = optimizer.param_groups[0]
        lacking = sorted(
            k for k in set(group) - set(groups[0]) - {"params"} if not isinstance(group[k], (bool, type(None)))
        )
        if not lacking:
            continue
        raise CheckpointMismatchError(
            f"The checkpoint's optimizer state does not fit this run's {type(optimizer).__name__}: it has no "
            f"{lacking} (it was saved by another kind of optimizer, or another version). Fix: build the same "
            "optimizer as the run that saved it, or start the optimizer fresh with "
            "CheckpointConfig(load_ignore_keys=['optimizers', 'schedulers']) or load_weights_only=True."
        )


def drop_ignored_keys(
    saved: Mapping[str, Any], patterns: Sequence[str], model_keys: Iterable[str]
) -> Tuple[Dict[str, Any], List[str]]:
    """``saved`` without the entries matching a glob in ``patterns``, and the model's keys they cover.

    Entries are named ``model/<param>``, ``algorithms/<key>``, ``callbacks/<key>`` and the top-level
    names (``optimizers``, ``schedulers``, ``timestamp``, ...). A pattern matching nothing raises.
    """
    patterns = list(patterns)
    used = set()

    def ignored(name: str) -> bool:
        hits = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
        used.update(hits)
        return bool(hits)

    out: Dict[str, Any] = {}
    for key, value in saved.items():
        if key in ("model", "algorithms", "callbacks") and isinstance(value, Mapping):
            out[key] = {k: v for k, v in value.items() if not ignored(f"{key}/{k}")}
        elif not ignored(key):
            out[key] = value
    if "algorithms_required" in out:
        out["algorithms_required"] = [k for k in out["algorithms_required"] if k in out.get("algorithms", {})]
    model_ignored = [k for k in model_keys if ignored(f"model/{k}")]
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ValueError(
            f"load_ignore_keys {unused} match no checkpoint entry: entries are model/<param name>, optimizers, "
            f"schedulers, timestamp, algorithms/<Name>, callbacks/<Name>, ... (this checkpoint: {sorted(saved)})."
        )
    return out, model_ignored


def _keyed(objects: Sequence[Any]) -> Dict[str, Any]:
    """Stable checkpoint keys: the class name, then ``Name#2``, ``Name#3`` for repeats."""
    keyed: Dict[str, Any] = {}
    for obj in objects:
        name = type(obj).__name__
        key, n = name, 1
        while key in keyed:
            n += 1
            key = f"{name}#{n}"
        keyed[key] = obj
    return keyed


def _load_list(what: str, targets: List[Any], states: List[Any]) -> None:
    if len(states) != len(targets):
        raise CheckpointMismatchError(
            f"The checkpoint has {len(states)} {what} but this run has {len(targets)}; "
            f"build the run with the same {what}, or load weights only."
        )
    for target, target_state in zip(targets, states):
        target.load_state_dict(target_state)
