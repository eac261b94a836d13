"""`Mixture`: named sources with weights that change in stages, as plain data.

A mixture says how much of each source an epoch holds and how that changes over the run. It is
plain data (`to_dict` / `from_dict`, equality, hashing), so it can be saved in a checkpoint,
compared on resume, and be a Ray Tune hyperparameter; the order it implies lives in
`raytrain_events.core.mixture_plan` (`Mixture.plan`).

Example::

    mixture = Mixture(
        sources={"web": 80_000, "code": 15_000, "math": 5_000},      # rows per source
        stages={"0dur": {"web": 0.7, "code": 0.2, "math": 0.1},       # proportions of each epoch
                "0.7dur": {"web": 0.4, "code": 0.3, "math": 0.3}},    # from 70% of the run on
    )

A stage's weights are either all proportions (numbers, normalised; a source left out gets 0) or
all absolute per-epoch amounts, as MosaicML Streaming's ``Stream(repeat=|choose=)``:
``{"web": {"repeat": 0.5}, "math": {"choose": 2000}}`` (``repeat`` times the source's rows, or
``choose`` rows). A stage listed in ``switches`` (`Mixture.switched`) changes the weights from its
start without changing the order before it: how a run continues from a checkpoint with new
weights (a PBT exploit). The epoch size is ``epoch_size`` when given, else the first stage's total when it
is absolute, else the sum of every source's rows; later stages split that same size in their
proportions. Stage starts are `Time` strings in ``dur`` (a fraction of the run), ``ep``, ``sp`` or
``ba``; the first stage starts at 0.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from raytrain_events.core.mixture_online import OnlineError, OnlinePolicy
from raytrain_events.core.mixture_plan import MixturePlan
from raytrain_events.core.time import Time, TimeUnit

__all__ = ["Mixture", "Source", "MixtureError", "StageWeight"]

StageWeight = Union[float, int, Mapping[str, float]]
_ABSOLUTE_KEYS = ("repeat", "choose")
_STAGE_UNITS = (TimeUnit.DURATION, TimeUnit.EPOCH, TimeUnit.SAMPLE, TimeUnit.BATCH)


class MixtureError(ValueError):
    """A mixture that cannot be trained on; the message names the problem and the fix."""


@dataclass(frozen=True)
class Source:
    """One named source: its row count and, optionally, its schema (column name -> type name).

    Schemas given here are compared when the mixture is built; loaders compare the schemas of
    the sources they open (a torch dataset's first row, a Parquet file's footer).
    """

    rows: int
    schema: Optional[Tuple[Tuple[str, str], ...]] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"rows": self.rows}
        if self.schema is not None:
            out["schema"] = dict(self.schema)
        return out


def _source(name: str, value: Any) -> Source:
    if isinstance(value, Source):
        source = value
    elif isinstance(value, Mapping):
        unknown = set(value) - {"rows", "schema"}
        if unknown or "rows" not in value:
            raise MixtureError(f"Source {name!r}: expected {{'rows': N, 'schema': {{...}}}}, got {dict(value)!r}.")
        schema = value.get("schema")
        source = Source(
            rows=value["rows"],
            schema=None if schema is None else tuple(sorted((str(k), str(v)) for k, v in schema.items())),
        )
    else:
        source = Source(rows=value)
    if not isinstance(source.rows, bool) and isinstance(source.rows, numbers.Integral):
        source = Source(rows=int(source.rows), schema=source.schema)  # a numpy integer counts
    if isinstance(source.rows, bool) or not isinstance(source.rows, int) or source.rows <= 0:
        raise MixtureError(
            f"Source {name!r} has rows={source.rows!r}: give its row count as a positive int "
            "(an empty source cannot be mixed; leave it out)."
        )
    return source


def _weight(stage: str, name: str, value: Any) -> Tuple[str, Fraction]:
    """('proportion' | 'repeat' | 'choose', amount) of one stage entry, checked."""
    if isinstance(value, Mapping):
        if len(value) != 1 or next(iter(value)) not in _ABSOLUTE_KEYS:
            raise MixtureError(
                f"Stage {stage!r}, source {name!r}: {dict(value)!r} is not a weight; give a proportion (a number), "
                "{'repeat': r} (r times the source's rows per epoch) or {'choose': n} (n rows per epoch)."
            )
        kind, amount = next(iter(value.items()))
    else:
        kind, amount = "proportion", value
    amount = _number(amount)
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount):
        raise MixtureError(f"Stage {stage!r}, source {name!r}: {kind} {amount!r} is not a finite number.")
    if amount < 0:
        raise MixtureError(
            f"Stage {stage!r}, source {name!r}: {kind} {amount!r} is negative; weights must be >= 0 "
            "(use 0, or leave the source out of the stage, to skip it)."
        )
    if kind == "choose" and not float(amount).is_integer():
        raise MixtureError(f"Stage {stage!r}, source {name!r}: choose={amount!r} must be a whole number of rows.")
    return kind, Fraction(repr(amount))  # the decimal as written: 0.3 is 3/10, not its binary float


def _number(value: Any) -> Any:
    """A numpy (or other `numbers.Real`) scalar as the Python number it prints as; other values unchanged."""
    if type(value) in (bool, int, float) or not isinstance(value, numbers.Real):
        return value  # np.float64 is a float subclass whose repr is 'np.float64(0.7)': converted below
    return int(value) if isinstance(value, numbers.Integral) else float(str(value))  # float32 0.3 is '0.3'


def _plain_weight(value: Any) -> Any:
    return {k: _number(v) for k, v in value.items()} if isinstance(value, Mapping) else _number(value)


def _check_names(what: str, names: Any) -> None:
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise MixtureError(
            f"{what} has names that are not strings: {odd!r}. Name every source with a string (the datasets' "
            f"keys): {{{', '.join(repr(str(n)) + ': ...' for n in odd)}}}."
        )


def _stage(
    key: str, weights: Mapping[str, Any], rows: Mapping[str, int]
) -> Tuple[Time[Any], Tuple[Tuple[str, Fraction], ...], bool]:
    """(start, per-source amounts in rows-per-epoch terms, absolute?) of one stage, checked."""
    try:
        start = Time.from_timestring(key)
    except (TypeError, ValueError) as exc:
        raise MixtureError(f"Stage start {key!r} is not a time string like '0dur', '0.7dur' or '2ep': {exc}") from None
    if start.unit not in _STAGE_UNITS:
        raise MixtureError(
            f"Stage {key!r} is in {start.unit.value}, which is not known before the data is read: "
            "start stages in 'dur', 'ep', 'sp' or 'ba'."
        )
    if start.value < 0 or (start.unit == TimeUnit.DURATION and start.value >= 1):
        raise MixtureError(
            f"Stage {key!r} starts outside the run: a stage in 'dur' starts in [0, 1) "
            "(0 is the start of training, 1 its end), and other units at >= 0."
        )
    unknown = sorted(set(weights) - set(rows))
    if unknown:
        raise MixtureError(
            f"Stage {key!r} names {unknown}, which are not sources (sources: {list(rows)}): "
            "check the spelling, or add them to sources."
        )
    checked = {name: _weight(key, name, value) for name, value in weights.items()}
    kinds = {"proportion" if kind == "proportion" else "absolute" for kind, _ in checked.values()}
    if len(kinds) > 1:
        raise MixtureError(
            f"Stage {key!r} mixes proportions with repeat/choose: give every source of a stage "
            "as a proportion, or every one as {'repeat': r} / {'choose': n}."
        )
    amounts = {}
    for name, source_rows in rows.items():
        kind, amount = checked.get(name, ("proportion", Fraction(0)))
        amounts[name] = amount * source_rows if kind == "repeat" else amount
    if sum(amounts.values()) == 0:
        raise MixtureError(f"Stage {key!r} has weights summing to 0: give at least one source a positive weight.")
    return start, tuple(amounts.items()), kinds == {"absolute"}


def _switch_start(key: str, starts: list[str]) -> str:
    """A ``switches`` entry, checked: the start of one of the stages after the first."""
    try:
        start = Time.from_timestring(str(key)).to_timestring()
    except (TypeError, ValueError):
        start = str(key)
    if start not in starts[1:]:
        raise MixtureError(
            f"switches names {key!r}, which is not the start of a stage after the first (stages start at "
            f"{starts}): name a stage's start, as Mixture.switched(at_sample, weights) does."
        )
    return start


@dataclass(frozen=True)
class Mixture:
    """Named sources (``{name: rows}`` or `Source`) and stages (``{start: {name: weight}}``); see the module docstring.

    ``weights={...}`` is the one-stage shorthand for ``stages={"0dur": {...}}``.
    """

    sources: Mapping[str, Any]
    stages: Optional[Mapping[str, Mapping[str, StageWeight]]] = None
    weights: Optional[Mapping[str, StageWeight]] = None
    epoch_size: Optional[int] = None
    switches: Tuple[str, ...] = ()
    online: Optional[Mapping[str, Any]] = None  # weights that adapt during the run: core/mixture_online.py
    # Checked, normalised forms (derived in __post_init__; not arguments).
    source_list: Tuple[Tuple[str, Source], ...] = field(init=False, repr=False, compare=False)
    stage_list: Tuple[Tuple[Time[Any], Tuple[Tuple[str, Fraction], ...]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.sources, Mapping) or not self.sources:
            raise MixtureError("Mixture(sources=...) needs at least one source: {'web': rows, 'code': rows, ...}.")
        _check_names("Mixture(sources=...)", self.sources)
        # Sorted by name: equal mixtures (dicts equal whatever their order) give the same plan.
        source_list = tuple(sorted((str(name), _source(str(name), value)) for name, value in self.sources.items()))
        object.__setattr__(self, "sources", {name: source.to_dict() for name, source in source_list})
        if (self.stages is None) == (self.weights is None):
            raise MixtureError(
                "Give the mixture's weights once: weights={'web': 0.7, ...} for one stage, or "
                "stages={'0dur': {...}, '0.7dur': {...}} for weights that change over the run."
            )
        stages = dict(self.stages) if self.stages is not None else {"0dur": dict(self.weights or {})}
        for key, weights in stages.items():
            if not isinstance(weights, Mapping):
                raise MixtureError(f"Stage {key!r} is {weights!r}: give {{source: weight, ...}}.")
            _check_names(f"Stage {key!r}", weights)
        object.__setattr__(
            self, "stages", {str(k): {n: _plain_weight(w) for n, w in v.items()} for k, v in stages.items()}
        )
        object.__setattr__(self, "weights", None)
        names = [name for name, _ in source_list]
        schemas = {name: s.schema for name, s in source_list if s.schema is not None}
        if len(set(schemas.values())) > 1:
            values = list(schemas.values())
            common = max(values, key=values.count)  # the most sources' schema (the first by name on a tie)
            first = next(n for n, s in schemas.items() if s == common)
            odd = next(n for n, s in schemas.items() if s != common)
            raise MixtureError(
                f"Source {odd!r} has another schema than {first!r} ({dict(schemas[odd] or ())} vs "
                f"{dict(common or ())}): mixed sources must share their columns and types; convert it first."
            )
        if self.epoch_size is not None and (
            isinstance(self.epoch_size, bool) or not isinstance(self.epoch_size, int) or self.epoch_size <= 0
        ):
            raise MixtureError(f"epoch_size={self.epoch_size!r} must be a positive int (samples per epoch) or None.")
        object.__setattr__(self, "source_list", source_list)
        object.__setattr__(self, "stage_list", self._check_stages(names))
        starts = [start.to_timestring() for start, _ in self.stage_list]
        switches = tuple(_switch_start(key, starts) for key in self.switches)
        object.__setattr__(self, "switches", switches)
        if self.online is not None:
            self._check_online(starts)

    def _check_online(self, starts: list[str]) -> None:
        """``online`` checked (`OnlinePolicy`); it adapts proportions, so the stages must be one of them plus switches."""
        assert self.stages is not None
        try:
            policy = OnlinePolicy.from_dict(self.online, self.names)  # type: ignore[arg-type]
        except OnlineError as exc:
            raise MixtureError(str(exc)) from None
        object.__setattr__(self, "online", policy.to_dict())
        if any(isinstance(w, Mapping) for weights in self.stages.values() for w in weights.values()):
            raise MixtureError(
                "online= adapts proportions, but this mixture gives absolute repeat/choose amounts: give its weights "
                "as proportions (plain numbers) to adapt them, or drop online= to keep the absolute amounts."
            )
        fixed = [start for start in starts[1:] if start not in self.switches]
        if fixed:
            raise MixtureError(
                f"online= adapts the weights during the run, but the mixture has stages at {fixed} of its own: give one "
                "stage (weights={...}) and let the policy change it, or drop online= to keep the stages."
            )

    def _check_stages(self, names: list[str]) -> Tuple[Tuple[Time[Any], Tuple[Tuple[str, Fraction], ...]], ...]:
        assert self.stages is not None
        if not self.stages:
            raise MixtureError("Mixture(stages={}) has no stage: give at least {'0dur': {source: weight, ...}}.")
        rows = {name: source.rows for name, source in self.source_list}
        out = [_stage(key, weights, rows) for key, weights in self.stages.items()]
        if out[0][0].value != 0:
            raise MixtureError(
                f"The first stage starts at {out[0][0].to_timestring()!r}: the first stage must start at '0dur' "
                "(the data needs weights from the first batch on)."
            )
        if self.epoch_size is None and out[0][2]:
            object.__setattr__(self, "epoch_size", int(sum(a for _, a in out[0][1])))
            if self.epoch_size == 0:
                raise MixtureError("The first stage's repeat/choose select no row: raise them, or give epoch_size.")
        elif self.epoch_size is None:
            object.__setattr__(self, "epoch_size", sum(rows.values()))
        for (_, amounts, absolute), key in zip(out, self.stages):
            total = sum(a for _, a in amounts)
            if absolute and total != self.epoch_size:
                raise MixtureError(
                    f"Stage {key!r} selects {float(total):g} rows per epoch with repeat/choose (absolute amounts), but "
                    f"the epoch is {self.epoch_size} samples (epoch_size, or the first stage's total): they would be read "
                    f"as proportions of {self.epoch_size}. Fix: amounts that add up to {self.epoch_size}, proportions "
                    "(plain numbers), or no epoch_size (the first stage's total then sets it)."
                )
        return tuple((start, amounts) for start, amounts, _ in out)

    # --------------------------------------------------------------- plain data
    @property
    def names(self) -> Tuple[str, ...]:
        """The source names, in the order every per-source list uses."""
        return tuple(name for name, _ in self.source_list)

    def rows(self, name: str) -> int:
        """Rows of source ``name``."""
        return dict(self.source_list)[name].rows

    def to_dict(self) -> Dict[str, Any]:
        """Plain data (JSON/YAML): ``Mixture.from_dict(m.to_dict()) == m``."""
        assert self.stages is not None
        out: Dict[str, Any] = {
            "sources": dict(self.sources),
            "stages": {k: dict(v) for k, v in self.stages.items()},
            "epoch_size": self.epoch_size,
        }
        if self.switches:
            out["switches"] = list(self.switches)
        if self.online is not None:
            out["online"] = dict(self.online)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Mixture:
        """Inverse of `to_dict` (also accepts ``weights=`` instead of ``stages=``)."""
        unknown = set(data) - {"sources", "stages", "weights", "epoch_size", "switches", "online"}
        if unknown:
            raise MixtureError(
                f"Unknown mixture keys {sorted(unknown)}: expected sources, stages (or weights), epoch_size, switches, "
                "online."
            )
        return cls(
            sources=data["sources"],
            stages=data.get("stages"),
            weights=data.get("weights"),
            epoch_size=data.get("epoch_size"),
            switches=tuple(data.get("switches") or ()),
            online=data.get("online"),
        )

    def switched(self, at_sample: int, weights: Mapping[str, StageWeight]) -> Mixture:
        """This mixture with new ``weights`` from global sample ``at_sample`` on, as a *switch* stage.

        A switch stage leaves every position before it as it was (the stage it cuts short keeps
        its order), so a run continued from a checkpoint at ``at_sample`` (a PBT exploit taking a
        donor's checkpoint with new weights) trains on from each source's cursor there. It must
        start after every stage's start.
        """
        assert self.stages is not None
        key = f"{int(at_sample)}sp"
        return Mixture(
            sources=self.sources,
            stages={**self.stages, key: dict(weights)},
            epoch_size=self.epoch_size,
            switches=(*self.switches, key),
            online=self.online,
        )

    def continues(self, earlier: Mixture) -> bool:
        """True if this mixture is ``earlier`` with switch stages added after its stages (see `switched`)."""
        assert self.stages is not None and earlier.stages is not None
        keys, before = list(self.stages), list(earlier.stages)
        return (
            self.sources == earlier.sources
            and self.epoch_size == earlier.epoch_size
            and self.online == earlier.online
            and keys[: len(before)] == before
            and all(self.stages[k] == earlier.stages[k] for k in before)
            and set(earlier.switches) <= set(self.switches)
            and all(Time.from_timestring(k).to_timestring() in self.switches for k in keys[len(before) :])
        )

    @classmethod
    def plain(cls, value: Union[Mixture, Mapping[str, Any]]) -> Dict[str, Any]:
        """A `Mixture` or its dict, checked, as plain data (``to_dict``): how `RayTrainer(mixture=...)` keeps it."""
        return (value if isinstance(value, Mixture) else cls.from_dict(value)).to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))  # equal mixtures, whatever their key order

    # --------------------------------------------------------------- the order
    def plan(
        self, *, seed: int, total_samples: Optional[int] = None, global_batch: Optional[int] = None
    ) -> MixturePlan:
        """The run's sample order (see `MixturePlan`): ``total_samples`` resolves 'dur' stages, ``global_batch`` 'ba'."""
        return MixturePlan(self, seed=seed, total_samples=total_samples, global_batch=global_batch)
