"""Online mixture weights: a policy that changes a `Mixture`'s weights during one run, as pure functions.

``Mixture(..., weights={...}, online={"policy": "exp3", "rate": 1.0})`` asks the run to change its
weights as it trains, from each source's held-out loss: an `Evaluator` per source (labelled by the
source's name, or as ``evaluators={source: label}`` says) whose loss metric (``metric``, or the
evaluator's one metric) the loop already computes and synchronizes across ranks at each eval. Every
rank reads the same synchronized losses at the same batch, so every rank computes the same new
weights with no collective of its own; the new weights apply from the next global batch's first
position, as a *switch* stage (`Mixture.switched`): the order before it is unchanged, and after it
the order is a pure function of (seed, the weights history, position). A run's weights history is
thus its mixture's switch stages: the checkpoint keeps them (with the losses that chose them,
`WeightsChange`), a resume or a resize rebuilds the same order, and the ledger (``core/ledger.py``)
answers from the saved mixture as for any staged mixture.

Policies (multiplicative weights over the sources, ``log a_i += rate * signal_i``, then
``w = (1 - floor) * softmax(log a) + floor / K`` so no source starves):

* ``"exp3"`` (Online Data Mixing, Albalak et al. 2023: EXP3 with the loss as the reward): the
  signal is each source's loss divided by the largest one. Every source is evaluated at every
  decision (full information), so the reward needs no importance weighting. Sources the model still
  gets most wrong gain weight; it needs nothing besides the per-source eval sets.
* ``"doremi"`` (DoReMi, Xie et al. 2023: excess loss over a reference): the signal is
  ``max(loss_i - reference_i, 0)``, the loss above what a reference model reaches on that source
  (``reference={source: loss}``, e.g. a proxy run's final per-source losses). Sources that are
  learnable but not yet learned gain weight; a source already at its reference does not.

Both steer by each source's own loss, blind to the task the run is for. ``"target"`` is aware of it:
``online={"policy": "target", "target": "<label>"}`` also reads the loss on the held-out set of the
task the run is for (the evaluator ``<label>``). When that task is drawn from the sources in shares
``pi``, its loss is exactly ``sum_i pi_i * loss_i`` for any model, so the eval history tells ``pi``:
at each decision `target_shares` fits, over every decision so far, the target's loss as a mixture
of the sources' losses (least squares on the simplex: the centred losses against the target's excess
over their mean, a light ridge toward uniform shares, then the projection onto the simplex), and the
log-weights move ``rate / (1 + rate)`` of the way to ``log(pi)`` (rate 1: half-way; 2: two thirds),
so the run trains on the mix its task is made of once the history shows it. A target that is no
mixture of the sources gets the mixture whose loss best follows its own. The policy's state is a
pure function of the recorded losses (each `WeightsChange` keeps the target's loss beside the
sources'), so a resume replays it exactly.

Why the eval losses and not per-source train losses: a batch's train loss is known after the
batch's per-batch sum has started (the loop sums its counters before forward), so it could only
ride the next batch's sum, and the last batch's value before a checkpoint would be pending on every
rank; a resume on another number of ranks could not restore it and would choose other weights. The
eval losses are complete and agreed at the batch where the eval runs.

Losses are rounded to `LOSS_DIGITS` decimals and weights to `WEIGHT_DIGITS` before use, so the
history holds short decimals (its plan uses their exact fractions) and float noise in the last bits
of a synchronized metric does not change a decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from raytrain_events.core.mixture import Mixture

__all__ = [
    "OnlineError",
    "OnlinePolicy",
    "WeightsChange",
    "POLICIES",
    "LOSS_DIGITS",
    "WEIGHT_DIGITS",
    "next_weights",
    "schedule",
    "apply_history",
    "initial_logs",
    "target_shares",
]

POLICIES = ("exp3", "doremi", "target")
LOSS_DIGITS = 4
WEIGHT_DIGITS = 6
_KEYS = ("policy", "rate", "floor", "reference", "metric", "evaluators", "target")
#: `target_shares`' ridge toward uniform shares, as a share of the centred losses' mean square.
TARGET_RIDGE = 1e-2


class OnlineError(ValueError):
    """An online policy that cannot run; the message names the problem and the fix."""


def _positive(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise OnlineError(f"online {what}={value!r} must be a positive finite number.")
    return float(value)


def _check_reference(policy: str, reference: Any, names: Sequence[str]) -> Optional[Mapping[str, Any]]:
    if policy == "doremi":
        if not isinstance(reference, Mapping) or sorted(reference) != sorted(names):
            raise OnlineError(
                f"online policy 'doremi' needs reference={{source: loss}} for every source {list(names)} "
                f"(got {reference!r}): a reference model's eval loss per source, e.g. a proxy run's."
            )
        for name, value in reference.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise OnlineError(f"online reference[{name!r}]={value!r} must be a finite number (a loss).")
    elif reference is not None:
        raise OnlineError("online reference= is for policy 'doremi' only: drop it, or use policy='doremi'.")
    return reference  # type: ignore[no-any-return]


def _check_target(policy: str, target: Any) -> Optional[str]:
    if policy == "target":
        if not isinstance(target, str) or not target:
            raise OnlineError(
                f"online policy 'target' needs target='<label>' (got {target!r}): the label of the evaluator (the "
                "eval set) of the task the run is for, e.g. online={'policy': 'target', 'target': 'heldout'} "
                "beside Evaluator(label='heldout', ...) (datasets={'heldout': ...} under RayTrainer)."
            )
    elif target is not None:
        raise OnlineError("online target= is for policy 'target' only: drop it, or use policy='target'.")
    return target  # type: ignore[no-any-return]


@dataclass(frozen=True)
class OnlinePolicy:
    """The checked ``online={...}`` of a `Mixture` (see the module docstring); plain data (`to_dict`)."""

    policy: str
    rate: float = 1.0
    floor: float = 0.05
    reference: Optional[Tuple[Tuple[str, float], ...]] = None
    metric: Optional[str] = None
    evaluators: Tuple[Tuple[str, str], ...] = field(default=())
    target: Optional[str] = None  # policy 'target': the evaluator label of the run's own held-out task

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], names: Sequence[str]) -> OnlinePolicy:
        """Check ``online={...}`` against the mixture's source ``names``; raise `OnlineError` naming the fix."""
        if not isinstance(data, Mapping):
            raise OnlineError(f"online={data!r}: give a dict, e.g. online={{'policy': 'exp3', 'rate': 1.0}}.")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise OnlineError(f"online has unknown keys {unknown}: expected some of {list(_KEYS)}.")
        policy = data.get("policy")
        if policy not in POLICIES:
            raise OnlineError(
                f"online policy={policy!r} is not a policy: use one of {list(POLICIES)} "
                "('exp3': more weight to the sources with the highest eval loss; 'doremi': to the sources "
                "whose eval loss most exceeds reference={source: loss}; 'target': toward the sources the eval set "
                "target='<label>' of the task the run is for is made of)."
            )
        rate = _positive("rate", data.get("rate", 1.0))
        floor = data.get("floor", 0.05)
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < 1:
            raise OnlineError(f"online floor={floor!r} must be in [0, 1): the share spread evenly over every source.")
        reference = _check_reference(str(policy), data.get("reference"), names)
        evaluators = dict(data.get("evaluators") or {})
        odd = sorted(set(evaluators) - set(names))
        if odd:
            raise OnlineError(f"online evaluators names {odd}, which are not sources (sources: {list(names)}).")
        target = _check_target(str(policy), data.get("target"))
        metric = data.get("metric")
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise OnlineError(f"online metric={metric!r} must be a metric name (a key of the model's eval metrics).")
        return cls(
            policy=str(policy),
            rate=rate,
            floor=float(floor),
            reference=None if reference is None else tuple(sorted((str(k), float(v)) for k, v in reference.items())),
            metric=metric,
            evaluators=tuple(sorted((str(k), str(evaluators.get(k, k))) for k in names)),
            target=target,
        )

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"policy": self.policy, "rate": self.rate, "floor": self.floor}
        if self.reference is not None:
            out["reference"] = dict(self.reference)
        if self.metric is not None:
            out["metric"] = self.metric
        if any(name != label for name, label in self.evaluators):
            out["evaluators"] = dict(self.evaluators)
        if self.target is not None:
            out["target"] = self.target
        return out

    def label(self, source: str) -> str:
        """The label of the evaluator whose loss is ``source``'s signal."""
        return dict(self.evaluators).get(source, source)

    def labels(self, names: Sequence[str]) -> List[str]:
        """Every evaluator label the policy reads: each source's (in ``names``' order), then the target's."""
        return [self.label(n) for n in names] + ([self.target] if self.target is not None else [])

    def signal(self, losses: Sequence[float]) -> List[float]:
        """Each source's signal from its (rounded) eval loss, in the sources' order (exp3, doremi)."""
        if self.policy == "exp3":
            top = max(max(losses), 1e-12)
            return [max(loss, 0.0) / top for loss in losses]
        assert self.reference is not None
        reference = [value for _, value in self.reference]  # sorted by name: the sources' order
        return [max(loss - ref, 0.0) for loss, ref in zip(losses, reference)]


def _normal(values: Sequence[float]) -> List[float]:
    total = sum(values)
    return [v / total for v in values]


def _rounded(weights: Sequence[float]) -> List[float]:
    return [round(w, WEIGHT_DIGITS) for w in weights]


def _solve(a: List[List[float]], b: List[float]) -> List[float]:
    """``x`` with ``a x = b`` (a small symmetric positive definite system: Gaussian elimination with pivoting)."""
    k = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    x = [0.0] * k
    for r in reversed(range(k)):
        x[r] = (m[r][k] - sum(m[r][c] * x[c] for c in range(r + 1, k))) / m[r][r]
    return x


def _onto_simplex(v: Sequence[float]) -> List[float]:
    """The Euclidean projection of ``v`` onto the probability simplex."""
    u = sorted(v, reverse=True)
    total, theta = 0.0, 0.0
    for i, x in enumerate(u, start=1):
        total += x
        if x - (total - 1) / i > 0:
            theta = (total - 1) / i
    return [max(x - theta, 0.0) for x in v]


def target_shares(past: Sequence[Tuple[Sequence[float], float]]) -> List[float]:
    """The shares ``pi`` of the sources that best explain the target's loss as ``sum_i pi_i * loss_i`` over
    ``past`` (each decision's (sources' losses, target's loss)): least squares on the simplex, a light ridge
    toward uniform shares (`TARGET_RIDGE`) so one decision already gives an estimate, projected onto the simplex."""
    k = len(past[0][0])
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for losses, target in past:
        mean = sum(losses) / k
        c = [x - mean for x in losses]  # sum_i pi_i * loss_i = mean + sum_i (pi_i - 1/k) * c_i, as the shares sum to 1
        for i in range(k):
            b[i] += c[i] * (target - mean)
            for j in range(k):
                a[i][j] += c[i] * c[j]
    ridge = TARGET_RIDGE * sum(a[i][i] for i in range(k)) / k + 1e-12
    for i in range(k):
        a[i][i] += ridge
    delta = _solve(a, b)  # in the span of the centred losses: it sums to 0
    return _onto_simplex([1 / k + d for d in delta])


def next_weights(
    policy: OnlinePolicy,
    log_weights: Sequence[float],
    losses: Sequence[float],
    *,
    target: Optional[float] = None,
    past: Sequence[Tuple[Sequence[float], Optional[float]]] = (),
) -> Tuple[List[float], List[float]]:
    """(the new log-weights, the weights to train on) after one decision on the rounded ``losses`` (and, for the
    policy 'target', the target's loss ``target`` and the earlier decisions' ``past`` (losses, target) pairs)."""
    losses = [round(float(x), LOSS_DIGITS) for x in losses]
    if policy.policy == "target":
        if target is None or any(t is None for _, t in past):
            raise OnlineError("online policy 'target' decides from the target's eval loss: none was given.")
        seen = [(list(x), float(t)) for x, t in past if t is not None]
        shares = target_shares([*seen, (losses, round(float(target), LOSS_DIGITS))])
        eta = policy.rate / (1 + policy.rate)
        logs = [(1 - eta) * a + eta * math.log(max(p, 1e-12)) for a, p in zip(log_weights, shares)]
    else:
        logs = [a + policy.rate * s for a, s in zip(log_weights, policy.signal(losses))]
    top = max(logs)
    logs = [a - top for a in logs]  # the same softmax, no overflow over a long run
    soft = _normal([math.exp(a) for a in logs])
    k = len(soft)
    return logs, _rounded([(1 - policy.floor) * p + policy.floor / k for p in soft])


def initial_logs(weights: Sequence[float]) -> List[float]:
    """The log-weights a run starts from: its first stage's proportions (a zero weight starts at -30)."""
    return [math.log(w) if w > 0 else -30.0 for w in _normal(weights)]


@dataclass(frozen=True)
class WeightsChange:
    """One decision: from global sample ``position`` (``batch`` batches trained) ``new`` replaces ``old``,
    chosen from ``losses`` (each source's eval loss, rounded) and, for the policy 'target', ``target`` (the
    target's eval loss, rounded). Plain data in the checkpoint."""

    position: int
    batch: int
    old: Tuple[float, ...]
    new: Tuple[float, ...]
    losses: Tuple[float, ...]
    target: Optional[float] = None

    def to_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        out = {
            "position": self.position,
            "batch": self.batch,
            "old": dict(zip(names, self.old)),
            "new": dict(zip(names, self.new)),
            "losses": dict(zip(names, self.losses)),
        }
        if self.target is not None:
            out["target"] = self.target
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], names: Sequence[str]) -> WeightsChange:
        return cls(
            position=int(data["position"]),
            batch=int(data["batch"]),
            old=tuple(float(data["old"][n]) for n in names),
            new=tuple(float(data["new"][n]) for n in names),
            losses=tuple(float(data["losses"][n]) for n in names),
            target=None if data.get("target") is None else float(data["target"]),
        )


def schedule(
    policy: OnlinePolicy,
    start: Sequence[float],
    losses: Sequence[Sequence[float]],
    targets: Optional[Sequence[float]] = None,
) -> List[List[float]]:
    """The weights after each decision, from the first stage's proportions ``start`` and each decision's
    losses (and target loss, for the policy 'target'): the weights history as a pure function of its signals
    (what a resume replays and checks)."""
    logs, out = initial_logs(start), []
    past: List[Tuple[Sequence[float], Optional[float]]] = []
    for i, one in enumerate(losses):
        target = None if targets is None else targets[i]
        logs, weights = next_weights(policy, logs, one, target=target, past=past)
        past.append(
            ([round(float(x), LOSS_DIGITS) for x in one], None if target is None else round(target, LOSS_DIGITS))
        )
        out.append(weights)
    return out


def apply_history(base: Mixture, history: Sequence[WeightsChange]) -> Mixture:
    """``base`` with each change as a switch stage at its position: the run's order is this mixture's plan."""
    mixture = base
    for change in history:
        mixture = mixture.switched(change.position, dict(zip(base.names, change.new)))
    return mixture
