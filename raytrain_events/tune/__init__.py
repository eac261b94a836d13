"""Ray Tune sweeps over algorithm sets and hyperparameters, each trial a distributed `RayTrainer` run.

Tune is a client of `RayTrainer`: each trial runs ``RayTrainer(base_spec.replace(...))``. The
package holds the sweep itself (`raytrain_events.tune.driver`: validate, prepare, run, collect),
what a trial runs (`.trial`), algorithm sets (`.sets`), releasing stopped trials' workers
(`.placement`), the results table (`.results`) and the sweep's console lines (`.console`).

Example (three algorithm sets x two learning rates, ASHA on the global sample count)::

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from raytrain_events.tune import algorithm_sets_grid, sweep

    result = sweep(
        trainer=dict(model=make_model, optimizers=make_sgd, datasets={"train": train_ds, "eval": eval_ds},
                     max_duration="4ep", batch_size=32, num_workers=2),
        param_space={
            "algorithms": algorithm_sets_grid([[], ["label_smoothing"], [{"name": "mixup", "alpha": 0.2}]]),
            "lr": tune.grid_search([0.05, 0.2]),            # reaches the factories as config["lr"]
        },
        metric="metrics/eval/accuracy", mode="max",
        scheduler=ASHAScheduler(time_attr="time/sample", max_t=4 * n_rows, grace_period=n_rows),
        storage_path="runs", name="algorithm-sweep",     # same name again resumes an interrupted sweep
    )
    print(result.to_table())
    print(result.best_algorithms, result.best_checkpoint)

How it runs
-----------
Each Tune trial is a function trainable that takes almost no CPU (``{"cpu": 0.01}``) and runs
``RayTrainer(trial_spec).fit()``, the trial's spec being the sweep's base `RunSpec` with the trial's
overrides applied (`RunSpec.replace`): Train V2 starts its own controller and
workers for the trial. Inside a Tune trial, the trainer's controller callback
(`raytrain_events.ray.reports.history.AggregatingCallback`) puts every aggregated history entry on
Tune's result queue (but those made while a save is pending, whose checkpoint comes with a later one), so Tune sees the driver's global Timestamp (``time/epoch``,
``time/batch``, ``time/sample``, ``time/token``, summed over all ranks), ``train/loss`` reduced
over all ranks' batches, eval metrics over the whole eval set, ``world_size`` and
``checkpoint_path`` -- never rank 0's local values. Any of the ``time/*`` keys can be a
scheduler's ``time_attr``.

The trial config (a sample of ``param_space``) is merged over ``trainer["config"]`` and given
to the model/optimizer/scheduler/dataset factories. Two keys are special:

* ``"algorithms"``: a list of algorithm specs (``"label_smoothing"``,
  ``{"name": "mixup", "alpha": 0.2}``) that replaces ``trainer["algorithms"]`` for the trial.
  Use `algorithm_sets_grid` (a grid) or ``tune.choice(sets)`` (a categorical).
* ``"trainer"``: a dict of `RayTrainer` keyword overrides (``batch_size``, ``max_duration``,
  ``seed``, ``num_workers``, ...), which may hold Tune domains themselves.

Storage
-------
The sweep lives in ``<storage_path>/<name>/`` (Tune's experiment folder). Each trial's Train run
goes to ``<storage_path>/<name>/<trial folder>/train/`` (its checkpoints, with a
`raytrain_events.checkpoint.CheckpointConfig` in ``trainer["checkpoint"]``, under ``.../train/checkpoints``),
and a trial that finished writes ``<trial folder>/raytrain_trial.json`` with its history.

Stopped trials
--------------
When Tune stops a trial early (a scheduler's STOP), it terminates the trial's actor, and with it
the trial's Train controller and workers; the placement group Train reserved for the workers
outlives them (it belongs to the job), and Ray Train's own cleaner for it needs the dashboard's
state API. So every worker group registers its placement group with the sweep, and the sweep
removes a trial's groups a few seconds after the trial ended -- otherwise each stopped trial
would keep its workers' CPUs/GPUs and later trials could wait for them forever.

Resuming
--------
``sweep(..., resume=True)`` with the same ``storage_path`` and ``name`` restores the sweep
(``Tuner.restore(..., resume_errored=True)``): finished trials are not run again, unfinished and
errored ones are restarted (from their own newest checkpoint when ``CheckpointConfig(autoresume=True)``),
and trials never started run. Tune saves its experiment state at most every ~10 s, so a sweep killed
right after a trial finished may not know it finished; such a trial finds its
``raytrain_trial.json`` and replays its recorded history to Tune instead of training again.

Searching the data mixture
--------------------------
``param_space={"mixture": mixture_space(mixture, concentration=1.0, num_samples=16, seed=0)}``
(or `mixture_grid` of given weights) gives each trial its own weights for ``trainer["mixture"]``'s
first stage; the table shows them (``mixture/<source>``) beside the tokens each source gave
(``mixture/tokens/<source>``). `regmix_search` fits the trials' loss as a function of the weights
(a GP, Bayesian ridge or LightGBM, each with its uncertainty, cross-validated) and returns the
mixture the fit stands behind (mean + std inside a trust region around the trials), which
`write_mixture_config` writes as a stages config for the full run. ``pbt_scheduler(interval,
mixture=mixture_space(mixture))`` explores the weights (`MixtureExplore`): a copy trains on the
donor's mixture switched at the donor checkpoint's global sample to its explored weights, from
the donor's exact Timestamp and per-source cursors; the lineage records both weights.
``sweep(search_alg=MixtureSearcher(mixture, initial=8, batch=4, max_trials=16), num_samples=16)``
refines in rounds: a space-filling first batch, then each next batch where the fit's lower confidence bound is
(inside a trust region around the best proxies).

Population-based training
-------------------------
``sweep(..., scheduler=pbt_scheduler("512sp", algorithm_sets=..., lr=...))``: trials report each
committed checkpoint to Tune as a tiny pointer (`raytrain_events.tune.pointer`; the bytes stay in
the run dir), so PBT can copy a top trial into a bottom one: the bottom trial starts a new run
(``from-<donor trial>-<checkpoint>``) in its folder that fully loads the donor's checkpoint (exact
global Timestamp, optimizer, data position) with its mutated config and algorithm set; algorithms
that stay on get their saved state back, ones turned off are dropped, new ones start fresh. Under PBT
trials keep every checkpoint (a donor must not prune one being copied). Each copy is in the trial's
``raytrain_lineage.json`` and in `SweepResult` (``row["lineage"]``, the table's ``copied`` column).

Files:

* ``acquisition.py``: Choosing weights through a fit: candidates on the simplex, a trust region, and a
  criterion with the uncertainty.
* ``console.py``: A sweep's console: one line per trial event instead of Tune's periodic status
  tables.
* ``driver.py``: `sweep()`: a Ray Tune sweep whose trials each train with `RayTrainer` (see
  `raytrain_events.tune`).
* ``explore.py``: Keep a PBT trial's explored optimizer settings when it loads another trial's
  checkpoint.
* ``mixture_fit.py``: The regression behind the mixture search: a fit of loss over mixture weights, with
  its uncertainty.
* ``mixture_searcher.py``: Refine the mixture in rounds: a Ray Tune `Searcher` that places each batch of
  proxies where the fit says.
* ``mixture_pbt.py``: PBT over mixture weights: explore on the simplex, the copy's mixture, and each
  trial's mixture over time.
* ``pbt_end.py``: PBT that knows a trial's final report: no copy into or out of a trial that has
  finished training.
* ``pbt.py``: Population-based training over algorithm sets: Tune's `PopulationBasedTraining`, set
  up for sweeps.
* ``placement.py``: Release the placement groups of trials Tune stopped.
* ``pointer.py``: Checkpoint pointers: what a Tune trial reports to Tune instead of copying its
  checkpoint.
* ``regmix.py``: RegMix-style proxy search: fit eval loss as a function of the mixture weights, choose
  weights the fit stands behind.
* ``results.py``: `SweepResult`: the table of a sweep's trials, the best algorithm set and its best
  checkpoint.
* ``sets.py``: Algorithm sets for sweeps: labels, validation, and the Tune grid over them.
* ``simplex.py``: Mixture weights as a search space: Dirichlet samples on the simplex, a grid of
  named mixtures.
* ``sweep_checks.py``: What `sweep()` checks before Ray starts and before any trial trains: the trials'
  base run, every ``param_space["trainer"]`` value, the metric's eval set, PBT without checkpoints.
* ``trial.py``: What one Tune trial runs: the sweep's base `RunSpec` with the trial's overrides, as
  a `RayTrainer` run.
"""

from raytrain_events.tune.acquisition import MixtureChoice, choose_mixture
from raytrain_events.tune.driver import sweep
from raytrain_events.tune.mixture_pbt import MixtureExplore, mixture_segments
from raytrain_events.tune.mixture_searcher import MixtureSearcher
from raytrain_events.tune.pbt import pbt_scheduler
from raytrain_events.tune.regmix import (
    best_mixture,
    fit_mixture_regression,
    read_mixture_config,
    regmix_search,
    write_mixture_config,
)
from raytrain_events.tune.results import TIME_ATTRS, TRIAL_RECORD, TRIAL_RUN_NAME, SweepResult
from raytrain_events.tune.sets import algorithm_set_label, algorithm_sets_grid
from raytrain_events.tune.simplex import mixture_grid, mixture_space

__all__ = [
    "sweep",
    "pbt_scheduler",
    "SweepResult",
    "algorithm_sets_grid",
    "algorithm_set_label",
    "mixture_space",
    "mixture_grid",
    "MixtureExplore",
    "mixture_segments",
    "fit_mixture_regression",
    "best_mixture",
    "choose_mixture",
    "MixtureChoice",
    "MixtureSearcher",
    "regmix_search",
    "write_mixture_config",
    "read_mixture_config",
    "TIME_ATTRS",
    "TRIAL_RECORD",
    "TRIAL_RUN_NAME",
]
