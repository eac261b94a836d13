"""Trainer set-up helpers: the train inputs checked (or absent, for eval/predict only), LR schedulers
from torch objects or `State` functions, epoch hand-off to loaders, and the duration of a further ``fit``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch

from raytrain_events.core.callback import Callback
from raytrain_events.core.data_spec import DataSpec, ensure_data_spec
from raytrain_events.core.interval import IntervalFn, make_interval
from raytrain_events.core.precision import Precision
from raytrain_events.core.state import State
from raytrain_events.core.time import Time, Timestamp, training_duration
from raytrain_events.core.time_value import check_countable
from raytrain_events.parallel.pipeline_step import PipelineCounters, PipelineStep
from raytrain_events.trainer.arguments import check_schedulers
from raytrain_events.trainer.counters import CountedModule
from raytrain_events.trainer.evaluation import ensure_evaluators
from raytrain_events.trainer.options import LoopOptions

if TYPE_CHECKING:
    from raytrain_events.core.engine import Engine
    from raytrain_events.dist import Dist
    from raytrain_events.parallel.pipeline_step import PipelineStep
    from raytrain_events.parallel.wrap import Parallel

__all__ = [
    "new_state",
    "as_list",
    "pipeline_step",
    "build_schedulers",
    "eval_intervals",
    "check_can_fit",
    "check_flags_agree",
    "set_duration",
    "set_epoch",
    "train_inputs",
    "TrainingHost",
    "wrap_for_training",
]


def train_inputs(
    train_dataloader: Any, max_duration: Optional[Time[Any]], optimizers: Any
) -> Tuple[Optional[DataSpec], Optional[Time[Any]]]:
    """The train data as a `DataSpec`, and ``max_duration`` (checked by `LoopOptions`) countable on it.

    Without train data (a Trainer for ``eval()``/``predict()`` only), ``max_duration`` and
    ``optimizers`` may be omitted: the data spec (and the duration, if omitted) is None.
    """
    if train_dataloader is None:
        return None, max_duration
    if max_duration is None:
        raise ValueError("train_dataloader given without max_duration: pass max_duration='10ep' (or '500ba', ...).")
    if optimizers is None:
        raise ValueError("No optimizers given: pass optimizers=torch.optim.AdamW(model.parameters(), lr=...).")
    spec = ensure_data_spec(train_dataloader, "train_dataloader")
    check_countable(max_duration, counts_tokens=spec.counts_tokens, what="max_duration")  # `tok` needs a counter
    return spec, max_duration


def check_can_fit(train_spec: Optional[DataSpec], state: State) -> None:
    """Raise if ``fit`` cannot run (a Trainer built for eval/predict only), naming what it lacks and the fix."""
    missing = [
        name
        for name, value in (
            ("train_dataloader", train_spec),
            ("max_duration", state.max_duration),
            ("optimizers", state.optimizers or None),
        )
        if value is None
    ]
    if missing:
        raise RuntimeError(
            f"fit() needs {', '.join(missing)}, which this Trainer was built without (it can eval() and predict()). "
            "Build the Trainer with train_dataloader=..., max_duration='10ep' and "
            "optimizers=torch.optim.AdamW(model.parameters(), lr=...) to train."
        )


def eval_intervals(
    eval_interval: Any, evaluators: Sequence[Any], max_duration: Optional[Time[Any]], counts_tokens: bool
) -> List[IntervalFn]:
    """Each evaluator's interval during fit (its own, else ``eval_interval``); none without a duration."""
    if max_duration is None:  # eval()/predict() only: fit never runs, so no interval fires
        return []
    default = make_interval(eval_interval, max_duration, counts_tokens=counts_tokens)
    return [
        default
        if e.eval_interval is None
        else make_interval(e.eval_interval, max_duration, counts_tokens=counts_tokens)
        for e in evaluators
    ]


def set_duration(
    state: State, counts_tokens: bool, duration: Union[str, int, Time[Any], None], reset_time: bool
) -> None:
    """The ``max_duration`` of a further fit: now + ``duration``, or ``duration`` from zero with ``reset_time``.

    ``counts_tokens``: whether the train data counts tokens (a duration in ``tok`` needs it).
    """
    assert state.max_duration is not None  # fit checked (check_can_fit)
    length = (
        state.max_duration
        if duration is None
        else training_duration(duration, counts_tokens=counts_tokens, what="fit(duration)")
    )
    if reset_time:
        state.timestamp = Timestamp()
        target = length
    else:
        target = Time(state.timestamp.get_value(length.unit) + length.value, length.unit)
    state.max_duration = target


def as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def build_schedulers(schedulers: List[Any], state: State) -> List[Any]:
    """Torch LR schedulers pass through; Composer-style ``fn(state) -> multiplier`` schedules are
    multiplied together (as in Composer) into one LambdaLR per optimizer."""
    torch_schedulers, functions = [], []
    for scheduler in schedulers:
        if hasattr(scheduler, "step") and hasattr(scheduler, "state_dict"):
            torch_schedulers.append(scheduler)
        elif callable(scheduler):
            functions.append(scheduler)
        else:
            raise TypeError(
                f"{scheduler!r} is not a scheduler: pass a torch.optim.lr_scheduler object or a "
                "raytrain_events.schedulers scheduler (a function of the State)."
            )
    if functions:
        if not state.optimizers:
            raise ValueError("A scheduler function needs an optimizer to schedule.")

        def multiplier(_state: State) -> float:
            value = 1.0
            for fn in functions:
                value *= fn(_state)
            return value

        torch_schedulers += [_StateLambdaLR(optimizer, multiplier, state) for optimizer in state.optimizers]
    return torch_schedulers


class _StateLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose multiplier is a function of the training `State` (its global Timestamp)."""

    def __init__(self, optimizer: torch.optim.Optimizer, fn: Callable[[State], float], state: State) -> None:
        self._fn, self._state = fn, state
        super().__init__(optimizer, lr_lambda=lambda _step: fn(state))

    def state_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k not in ("lr_lambdas", "_fn", "_state")}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # LambdaLR.load_state_dict pops "lr_lambdas", which state_dict() above leaves out; the
        # multiplier is a function of the State, so there is nothing of it to restore.
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in ("lr_lambdas", "_fn", "_state")})


def data_callbacks(spec: Optional[DataSpec]) -> List[Callback]:
    """Callbacks a train loader brings along through ``loop_callbacks()`` (`MixtureLoader`: per-source counts)."""
    make = getattr(spec.dataloader if spec is not None else None, "loop_callbacks", None)
    return list(make()) if callable(make) else []


def set_epoch(loader: Any, epoch: int) -> None:
    for target in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        set_epoch = getattr(target, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


class TrainingHost(Protocol):
    """What `wrap_for_training` reads: the loop's state, process group, parallelism and device."""

    state: State
    dist: Dist
    parallel: Parallel
    device: torch.device


def wrap_for_training(host: TrainingHost, counted: bool) -> Tuple[torch.nn.Module, Optional[Any]]:
    """The module the loop calls for training, and the DDP wrapper if that is what it is.

    ``counted``: under DDP on the CPU, wrap a `CountedModule`, whose extra parameter carries the
    batch counters; not with ``find_unused_parameters`` (DDP would mark that parameter unused after
    forward, then ready again when backward reaches it), and not on a GPU (reading them back would
    sync the host every batch; see `raytrain_events.trainer.counters`): there the counters keep
    their own host-side collective.
    """
    from torch.nn.parallel import DistributedDataParallel

    state, dist, parallel, device = host.state, host.dist, host.parallel, host.device
    find_unused = any(a.find_unused_parameters for a in state.algorithms)
    model = state.model
    on_host = device.type == "cpu"
    if counted and on_host and not find_unused and dist.is_distributed and not parallel.sharded:
        model = CountedModule(model, dist.world_size)
    wrapped = parallel.wrap(model, dist, device, find_unused, state.optimizers)
    return wrapped, wrapped if isinstance(wrapped, DistributedDataParallel) else None


def pipeline_step(host: Any) -> Optional[PipelineStep]:
    """Under pipeline parallelism, what runs each batch through the schedule (`PipelineStep`); else None
    (and None for a Trainer without train data: evaluation and predict run the stages themselves,
    `raytrain_events.parallel.pipeline_eval`)."""
    pipeline = host.parallel.pipeline
    if pipeline is None or host.train_spec is None:
        return None

    engine: Engine = host.engine
    coordinates = host.parallel.data_parallel(host.dist.rank, host.dist.world_size)  # (its pipeline, pipelines)
    counters = PipelineCounters(host.dist, host.state, coordinates, pipeline)
    return PipelineStep(state=host.state, engine=engine, pipeline=pipeline, spec=host.train_spec, counters=counters)


def check_flags_agree(state: State, dist: Dist) -> None:
    """Fail fast if ranks registered different agreement flags (their sums would not line up)."""
    if not dist.is_distributed:
        return
    names: List[Any] = dist.all_gather_object(state.agreement.names)
    if any(n != names[0] for n in names):
        raise RuntimeError(
            f"Ranks registered different agreement flags: {dict(enumerate(names))}. Build the same "
            "callbacks and checkpoint config on every rank."
        )


def new_state(  # noqa: PLR0913 (keyword-only: what Trainer.__init__ checked, handed over once)
    *,
    model: torch.nn.Module,
    duration: Any,
    train_spec: Optional[DataSpec],
    eval_dataloader: Any,
    options: LoopOptions,
    optimizers: Any,
    schedulers: Any,
    algorithms: List[Any],
    callbacks: List[Callback],
    dist: Dist,
    device: torch.device,
    run_name: str,
) -> State:
    """The run's `State`: its model, data (and the data's own callbacks), optimizers and schedulers (checked),
    algorithms and callbacks, rank and seed, and the AMP scaler under fp16."""
    state = State(
        model=model,
        max_duration=duration,
        train_dataloader=train_spec.dataloader if train_spec is not None else None,
        evaluators=ensure_evaluators(eval_dataloader),
        grad_accum=options.initial_grad_accum,
        precision=options.precision,
        optimizers=optimizers,
        schedulers=None,
        algorithms=algorithms,
        callbacks=[*callbacks, *data_callbacks(train_spec)],
        rank=dist.rank,
        world_size=dist.world_size,
        run_name=run_name,
        seed=options.seed,
        count_tokens=train_spec.num_tokens_in_batch if train_spec is not None and train_spec.counts_tokens else None,
        device_transforms=train_spec.device_transforms if train_spec is not None else None,
    )
    check_schedulers(as_list(schedulers), state.optimizers)
    state.schedulers = build_schedulers(as_list(schedulers), state)
    if state.precision is Precision.AMP_FP16:
        state.scaler = torch.amp.GradScaler(device.type)
    return state
