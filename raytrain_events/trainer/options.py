"""`LoopOptions`: the one definition of the training loop's options, shared by `Trainer` and `RunSpec`.

Each option is a field here with its default and its meaning (``help``), and is checked once, in
``__post_init__``, into the typed value the loop receives (a `Time` for durations, a `Precision`);
the options are frozen after that.
`Trainer(**options)` builds one from its keyword arguments; `raytrain_events.ray.spec.RunSpec`
*is* one (it subclasses `LoopOptions`), so a `RayTrainer` run's loop options have the same names,
defaults and checks, and the Ray worker hands the spec to its `Trainer` as they are (as
torchtitan's ``Trainer.Config``).

``seed`` defaults to 0 for both: a run must be reproducible without asking, and a distributed run
needs one seed that every rank shares (the same initial weights, one global data order), which an
unseeded default cannot give. ``seed=None`` leaves the random generators as they are.

Adding a loop option = one field here + the place in the loop that uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Union, cast

from raytrain_events.core.precision import Precision
from raytrain_events.core.time import Time, TimeUnit, ensure_time, training_duration
from raytrain_events.parallel.config import parse_parallelism
from raytrain_events.parallel.pipeline import check_pipeline_loop
from raytrain_events.trainer.compiling import compile_options

if TYPE_CHECKING:
    from raytrain_events.parallel.config import ParallelismSpec

__all__ = ["LoopOptions", "loop_option_names", "option", "refuse_unknown"]

AUTO = "auto"  # grad_accum="auto" (`raytrain_events.trainer.microbatching`)


def option(default: Any = dataclasses.MISSING, *, help: str, worker: bool = True, factory: Any = None) -> Any:
    """An option field: ``help`` documents it; ``worker=False`` (a `RunSpec` field) keeps it on the driver."""
    metadata = {"help": help, "worker": worker}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _set(options: LoopOptions, name: str, value: Any) -> None:
    # The options are frozen once built; their own check writes each typed value once, here.
    object.__setattr__(options, name, value)


def parse_grad_accum(value: Union[int, str]) -> int:
    """The starting number of microbatches for ``grad_accum`` (``"auto"`` starts at 1); bad values raise."""
    if value == AUTO:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"grad_accum={value!r} must be an integer >= 1 (microbatches per batch) or 'auto' "
            "(start with 1 and double on a device out-of-memory error)."
        )
    return value


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """How the loop trains: duration, evaluation cadence, microbatching, precision, sharding, seed.

    Example::

        options = LoopOptions(max_duration="3ep", grad_accum=2, precision="amp_bf16")
        Trainer(model=m, train_dataloader=dl, optimizers=opt, options=options)
        Trainer(model=m, train_dataloader=dl, optimizers=opt, max_duration="3ep", grad_accum=2)  # the same

    Validated on construction (and on ``dataclasses.replace``): bad input fails here with a message
    naming the option and the fix.
    """

    max_duration: Optional[Time[Any]] = option(
        None,
        help="how long to train: '10ep', '500ba', '1e6sp', '1e9tok' (an int is epochs); None: a Trainer for "
        "eval()/predict() only",
    )
    eval_interval: Any = option("1ep", help="how often to evaluate the eval sets: '1ep', '100ba', '0.5dur', or fn")
    grad_accum: Union[int, str] = option(
        1, help="micro-batches per optimizer step, or 'auto': double them on a device out-of-memory error"
    )
    precision: Union[str, Precision] = option("fp32", help="'fp32', 'amp_fp16' or 'amp_bf16'")
    parallelism: Any = option(
        "ddp", help="'ddp' (a model replica per worker), or 'fsdp' / an FSDPConfig: shard the model over the workers"
    )
    compile: Any = option(False, help="torch.compile the model on each rank: True, or a dict of torch.compile options")
    seed: Optional[int] = option(
        0, help="seed for weights (the same on every rank) and shuffling; None: leave the generators unseeded"
    )
    config: Dict[str, Any] = option(
        help="the job's own config: saved with the run and its checkpoints (RayTrainer: passed to the factories)",
        factory=dict,
    )

    def __post_init__(self) -> None:
        if self.max_duration is not None:
            # Not `dur`, positive; `tok` needs a token counter, checked where the data is known
            # (`Trainer`: its DataSpec; `RunSpec`: get_num_tokens_in_batch).
            _set(self, "max_duration", training_duration(self.max_duration))
        if not callable(self.eval_interval):  # else fn(state, event) -> bool
            _set(self, "eval_interval", ensure_time(self.eval_interval, TimeUnit.EPOCH))
        # What the loop needs of grad_accum, parallelism and compile, resolved here once (not fields:
        # the options keep the values as given, for the run's config.yaml and Tune's overrides).
        _set(self, "_initial_grad_accum", parse_grad_accum(self.grad_accum))
        _set(self, "precision", Precision.parse(self.precision))
        _set(self, "_parallelism", parse_parallelism(self.parallelism))
        if self.parallelism_spec.pipeline_parallel > 1:  # grad_accum and precision against the pipeline's microbatches
            check_pipeline_loop(self.parallelism_spec.fsdp, self.grad_accum, self.precision, self.compile)  # type: ignore[arg-type]
        _set(self, "_compile_kwargs", compile_options(self.compile))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed={self.seed!r} must be an integer, or None to leave the generators unseeded.")
        if not isinstance(self.config or {}, Mapping):
            raise TypeError(f"config={self.config!r} must be a dict (the job's own settings).")
        _set(self, "config", dict(self.config or {}))

    @property
    def auto_microbatching(self) -> bool:
        """``grad_accum="auto"``: double the microbatches after a device out-of-memory error."""
        return self.grad_accum == AUTO

    @property
    def initial_grad_accum(self) -> int:
        """The microbatches per batch to start with (1 for ``"auto"``)."""
        return cast(int, self.__dict__["_initial_grad_accum"])  # not fields: written once by __post_init__ (_set)

    @property
    def parallelism_spec(self) -> ParallelismSpec:
        """``parallelism`` resolved: DDP, or FSDP with its `FSDPConfig`."""
        return cast("ParallelismSpec", self.__dict__["_parallelism"])

    @property
    def compile_kwargs(self) -> Optional[Dict[str, Any]]:
        """``torch.compile``'s keyword arguments, or None for an eager model."""
        return cast(Optional[Dict[str, Any]], self.__dict__["_compile_kwargs"])

    @classmethod
    def build(cls, options: Optional[LoopOptions], changes: Mapping[str, Any], where: str = "Trainer") -> LoopOptions:
        """``options`` (default: all defaults) with ``changes`` applied; unknown names raise a TypeError."""
        refuse_unknown(
            changes,
            loop_option_names(),
            f"{where} got {{names}}, which is not an argument; its loop options (LoopOptions fields)",
        )
        if options is None:
            return cls(**changes)
        if not isinstance(options, LoopOptions):
            raise TypeError(f"options must be a LoopOptions, got {type(options).__name__} {options!r}.")
        return dataclasses.replace(options, **changes) if changes else options


def loop_option_names() -> List[str]:
    """Every `LoopOptions` field, in declaration order."""
    return [f.name for f in dataclasses.fields(LoopOptions)]


def refuse_unknown(names: Any, known: Sequence[str], head: str) -> None:
    """Raise a TypeError for any of ``names`` not in ``known``: ``head`` (with ``{names}``) + the known names."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise TypeError(head.format(names=", ".join(map(repr, unknown))) + f" are: {', '.join(known)}.")
