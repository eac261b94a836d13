"""Algorithm sets for sweeps: labels, validation, and the Tune grid over them."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

from raytrain_events.core.algorithm import Algorithm


def normalize_set(algorithms: Any) -> List[Any]:
    """One algorithm set as a list of specs (``None`` and ``[]`` are the empty set)."""

    if algorithms is None:
        return []
    if isinstance(algorithms, (str, Mapping, Algorithm)):
        return [algorithms]
    if isinstance(algorithms, (list, tuple)):
        return list(algorithms)
    raise TypeError(
        f"An algorithm set must be a list of specs like ['label_smoothing', {{'name': 'mixup', 'alpha': 0.2}}], "
        f"got {type(algorithms).__name__} {algorithms!r}."
    )


def _spec_label(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "name")
        return f"{spec.get('name')}({kwargs})" if kwargs else str(spec.get("name"))
    return type(spec).__name__


def algorithm_set_label(algorithms: Any) -> str:
    """A short readable name for an algorithm set: ``"label_smoothing+mixup(alpha=0.2)"``, ``"none"``."""
    specs = normalize_set(algorithms)
    return "+".join(_spec_label(s) for s in specs) if specs else "none"


def validate_set(algorithms: Any) -> List[Any]:
    """Build every spec once on the driver, so a typo fails before any trial starts."""
    # why here: defers torch.distributed.tensor (the Ray driver, algorithms load it) until a sweep needs it
    from raytrain_events.algorithms.registry import build_algorithm

    specs = normalize_set(algorithms)
    for spec in specs:
        if isinstance(spec, (list, tuple)):
            raise TypeError(
                f"An algorithm set holds a list ({spec!r}): to sweep over several sets, pass "
                "algorithm_sets_grid([set1, set2, ...]) or tune.choice([set1, set2, ...]) as param_space['algorithms']."
            )
        try:
            build_algorithm(spec)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Algorithm set {algorithm_set_label(specs)!r}: {exc}") from None
    return specs


def algorithm_sets_grid(sets: Sequence[Any], *, validate: bool = True) -> Dict[str, List[List[Any]]]:
    """``tune.grid_search`` over algorithm sets, for ``param_space["algorithms"]``.

    Each set is a list of specs (``[]`` for none, ``["label_smoothing"]``,
    ``[{"name": "mixup", "alpha": 0.2}, "label_smoothing"]``); a lone spec is a one-element set.
    With ``validate`` every spec is built once here, so unknown names or bad arguments fail now
    (listing the known algorithms), not inside a trial.
    """
    from ray import tune

    if isinstance(sets, (str, Mapping)) or not isinstance(sets, Sequence) or not sets:
        raise ValueError(f"algorithm_sets_grid needs a non-empty list of algorithm sets, got {sets!r}.")
    normalized = [validate_set(s) if validate else normalize_set(s) for s in sets]
    labels = [algorithm_set_label(s) for s in normalized]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"algorithm_sets_grid got the same set more than once: {duplicates}.")
    return tune.grid_search(normalized)


def space_choices(value: Any) -> List[Any]:
    """The values a ``param_space`` entry lists, for validation before Ray starts: a grid's values, a
    categorical's categories, or the one value given; ``[]`` for a sampled domain or a function (nothing to
    check up front). Algorithm sets and mixture weights are checked through it."""
    from ray.tune.search.sample import Categorical, Domain

    if isinstance(value, Mapping) and set(value) == {"grid_search"}:
        return list(value["grid_search"])
    if isinstance(value, Categorical):
        return list(value.categories)
    if isinstance(value, Domain) or callable(value):
        return []  # sampled by a function: nothing to check up front
    return [value]
