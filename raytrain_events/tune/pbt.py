"""Population-based training over algorithm sets: Tune's `PopulationBasedTraining`, set up for sweeps.

Every ``perturbation_interval`` (global samples or tokens, the ``time/sample`` / ``time/token``
counters every trial reports), the trials in the bottom quantile copy a top trial: Tune hands
them the top trial's last reported checkpoint pointer (`raytrain_events.tune.pointer`), and the
trial starts a new run in its folder that fully loads that checkpoint (weights, optimizer, exact
global Timestamp, data position) with a mutated config: another algorithm set from
``algorithm_sets`` (resampled or a neighbour in the list), perturbed numeric args and LR, and
mixture weights perturbed on the simplex (``mixture=``, `raytrain_events.tune.mixture_pbt`). The
trial records the copy in its lineage (`SweepResult.lineage`). A trial's final report moves
nothing (`raytrain_events.tune.pbt_end`): a copy into or out of a finished run would restart a worker
group to train no batch; and no trial is paused to make room while the sweep runs every live trial at once.

Trials must save checkpoints at least as often as they report at a perturbation: PBT copies the
checkpoint reported with a top trial's latest result, and skips the exploit if that result
carried none. Save at every report (``CheckpointConfig(save_interval=...)`` equal to the report
interval) or make the perturbation interval a multiple of the save interval. The reports due while a save
postponed by slow storage waits reach the run's history, not Tune: Tune's result there is the save's own report,
and a timed report at an epoch's last batch goes out at the epoch's end (`RayReporter`), so the result at a save
point carries its checkpoint. A metric that
`AsyncValidation` computes arrives in a result of its own, after its checkpoint's: `sweep` refuses it as
PBT's metric.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

from raytrain_events.core.time import Time, TimeUnit, ensure_time, report_key
from raytrain_events.tune.mixture_pbt import MixtureExplore
from raytrain_events.tune.pbt_end import EndAwarePBT
from raytrain_events.tune.sets import space_choices, validate_set

__all__ = ["pbt_scheduler"]


def pbt_scheduler(
    perturbation_interval: Union[str, Time],
    *,
    algorithm_sets: Any = None,
    lr: Any = None,
    hyperparam_mutations: Optional[Mapping[str, Any]] = None,
    mixture: Any = None,
    mixture_scale: float = 0.3,
    seed: Optional[int] = None,
    quantile_fraction: float = 0.25,
    resample_probability: float = 0.25,
    burn_in_period: Union[str, Time, None] = None,
    synch: bool = False,
    **options: Any,
) -> Any:
    """Tune's `PopulationBasedTraining` measuring time in global samples or tokens (`EndAwarePBT`: no copy
    into or out of a trial at its final report, where the copy would train nothing).

    ``perturbation_interval``: a `Time` (or string) in samples (``"512sp"``) or tokens
    (``"1e6tok"``). ``algorithm_sets``: the sets a trial may switch to, a list of sets or
    `algorithm_sets_grid(...)`'s value. ``lr``: the LR's mutation (a list of values, a Tune
    domain such as ``tune.loguniform(1e-4, 1e-1)``, or a function), mutating ``config["lr"]``.
    ``hyperparam_mutations``: any other config keys' mutations (Tune's format; numeric values are
    perturbed by PBT's factors). ``mixture``: a `mixture_space(<the trainer's mixture>)` domain;
    a copy's ``config["mixture"]`` is then perturbed on the simplex by `MixtureExplore` (with
    ``mixture_scale``, ``resample_probability`` and ``seed``), and its run trains on the donor's
    mixture switched at the donor checkpoint's global sample to those weights (`copy_mixture`):
    exact Timestamp, each source from the donor's cursor. The sweep must search the mixture too
    (``param_space={"mixture": mixture_space(...)}``). ``options``: more
    `PopulationBasedTraining` arguments.
    """
    from ray.tune.schedulers import PopulationBasedTraining  # deferred: Ray Tune loads when a sweep is set up

    interval = _samples_or_tokens(perturbation_interval, "perturbation_interval")
    mutations = _mutations(algorithm_sets, lr, hyperparam_mutations)
    if mixture is not None:  # explore config["mixture"] on the simplex; the copy switches at the donor's sample
        options["custom_explore_fn"] = MixtureExplore(
            mixture,
            scale=mixture_scale,
            resample_probability=resample_probability,
            seed=seed,
            then=options.get("custom_explore_fn"),
        )
    if not mutations and mixture is None:
        raise ValueError(
            "pbt_scheduler needs something to mutate: pass algorithm_sets=, lr=, mixture= or hyperparam_mutations=."
        )
    # Results without the metric are normal (entries between evaluations; the final report of a
    # copy that loaded a finished donor trains no batch): PBT skips them instead of failing.
    options.setdefault("require_attrs", False)
    # Synchronous PBT waits for every trial at each point, final reports included: Tune's own class.
    scheduler = (PopulationBasedTraining if synch else EndAwarePBT)(
        time_attr=report_key(interval.unit),
        perturbation_interval=interval.value,
        burn_in_period=_burn_in(burn_in_period, interval),
        hyperparam_mutations=mutations,
        quantile_fraction=quantile_fraction,
        resample_probability=resample_probability,
        synch=synch,
        **options,
    )
    # What `sweep` checks before Ray starts (tune/mixture_pbt.check_mixture_pbt): the weights PBT explores.
    scheduler.raytrain_mixture_explore = options["custom_explore_fn"] if mixture is not None else None
    return scheduler


def _mutations(algorithm_sets: Any, lr: Any, hyperparam_mutations: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """PBT's ``hyperparam_mutations``: the given ones, the algorithm sets a trial may switch to (two at least,
    each checked) and the LR's."""
    mutations: Dict[str, Any] = dict(hyperparam_mutations or {})
    if algorithm_sets is not None:
        listed = isinstance(algorithm_sets, (list, tuple))  # a list of sets, or algorithm_sets_grid(...)'s value
        sets = list(algorithm_sets) if listed else space_choices(algorithm_sets)
        if len(sets) < 2:
            raise ValueError(
                f"pbt_scheduler(algorithm_sets=...) needs at least two sets to switch between, got {sets!r}."
            )
        mutations["algorithms"] = [validate_set(s) for s in sets]
    if lr is not None:
        mutations["lr"] = lr
    return mutations


def _burn_in(burn_in_period: Union[str, Time, None], interval: Time) -> Any:
    """PBT's ``burn_in_period`` in ``interval``'s unit (0: none)."""
    if burn_in_period is None:
        return 0
    burn = _samples_or_tokens(burn_in_period, "burn_in_period")
    if burn.unit != interval.unit:
        raise ValueError(
            f"burn_in_period={burn_in_period!r} must be in the unit of perturbation_interval ({interval})."
        )
    return burn.value


def _samples_or_tokens(value: Union[str, Time], name: str) -> Time:
    time = ensure_time(value, TimeUnit.SAMPLE)
    if time.unit not in (TimeUnit.SAMPLE, TimeUnit.TOKEN) or time.value <= 0:
        raise ValueError(
            f"pbt_scheduler({name}={value!r}): give a positive time in global samples ('512sp') or tokens "
            "('1e6tok'): every trial reports both, and they mean the same across worker counts and batch sizes."
        )
    return time
