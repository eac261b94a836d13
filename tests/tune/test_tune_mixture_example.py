"""``examples/tune_mixture.py``: its proxies as a 4-trial Ray PBT sweep, and the RegMix-style search beating uniform.

The sweep (``proxy_trials_on_ray``, the example's ``--ray`` path, on the session's Ray): 4 trials of
`RayTrainer` (one worker each) on Dirichlet-drawn mixtures, under PBT over the weights
(``pbt_scheduler(mixture=...)``); each trial's per-source samples and tokens add up to its global
Timestamp, each source's eval set gives its own loss, and the table shows the weights and the
tokens per source; a copy continues on the donor's mixture switched at the donor checkpoint's
sample, from its exact Timestamp, its rows continuing the donor's. Why a sweep of its own: a
mixture replaces a run's train set, and the existing sweeps (the algorithm-set grid, ASHA, PBT,
resume) each check their own train set's trials. Two test-only instruments, as in
tests/tune/test_tune_pbt.py: ``FitRows`` (each fit's start and rows) and ``StartTogether``.

The search: one run of the example (proxies with the local `Trainer`, then full runs of the chosen and the
uniform mixture over two seeds). The margin asserted is the measured one with room for another
machine's float order: measured 0.21 (16 trials, 3 seeds) and 0.26 (this test's 12 trials, 2 seeds).
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import pytest
from ray import cloudpickle as ray_cloudpickle
from tune_helpers import wait_until

from raytrain_events import Callback
from raytrain_events.core.mixture import Mixture
from tests.example_scripts import load_example

ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the trials get this file's callbacks by value


def _example():
    return load_example("tune_mixture.py", "tune_mixture_example")


def test_the_searched_mixture_beats_uniform_on_the_held_out_task(tmp_path, capsys):
    example = _example()
    out = str(tmp_path / "chosen.yaml")
    found = example.main(["--trials", "12", "--seeds", "2", "--out", out])
    fit = found["found"].fit
    assert fit.n_points == 12 and fit.cv_rmse < fit.baseline_rmse / 2  # the fit predicts held-out trials
    weights = found["found"].weights
    assert weights["help"] > weights["small"] > weights["noise"]  # noise is left out, small kept in a smaller share
    assert weights["noise"] < 0.1 and weights["small"] > 0.05
    assert found["margin"] > 0.1  # measured 0.263 with these arguments (chosen 0.145, uniform 0.408)
    assert all(c < u for c, u in zip(found["chosen_losses"], found["uniform_losses"]))  # on every seed
    with open(out) as f:
        assert "stages" in f.read()
    assert example.read_mixture_config(out) == Mixture.from_dict(found["found"].mixture.to_dict())
    printed = capsys.readouterr().out
    assert "held-out RMSE" in printed and "lower by" in printed


class FitRows(Callback):
    """Rank 0 writes, per fit, the Timestamp it starts at and its mixture, then each trained batch's rows (``x``)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def fit_start(self, state, logger) -> None:
        loader = getattr(state.train_dataloader, "dataloader", state.train_dataloader)
        start = {u: state.timestamp.get_value(u) for u in ("ep", "ba", "sp", "tok")}
        self.file = open(os.path.join(self.folder, f"fit-{uuid.uuid4().hex[:8]}.jsonl"), "w")
        self.file.write(json.dumps({"start": start, "mixture": loader.mixture.to_dict()}) + "\n")
        self.file.flush()

    def batch_end(self, state, logger) -> None:
        rows = {"sp": state.timestamp.get_value("sp"), "x": state.batch["x"].tolist()}
        self.file.write(json.dumps(rows) + "\n")
        self.file.flush()


class StartTogether(Callback):
    """The population's first fits wait for each other (files in a shared folder), so that asynchronous PBT
    compares them on a loaded machine (as in tests/tune/test_tune_pbt.py); copies pass."""

    def __init__(self, folder: str, population: int, stop: str) -> None:
        self.folder, self.population, self.stop = folder, population, stop

    def fit_start(self, state, logger) -> None:
        with open(os.path.join(self.folder, f"started-{uuid.uuid4().hex[:8]}"), "w"):
            pass
        wait_until(lambda: len(os.listdir(self.folder)) >= self.population, self.stop)


class CopyTheLast(Callback):
    """Makes PBT's one copy certain: the trial on ``last`` weights is scored first at 192 samples and last at 384.

    Asynchronous PBT scores a trial at its own perturbation points (192 and 384 here) against the
    scores the others have at that moment, and a donor must have been in the top quantile at its
    own last one. The scheduler marks each result it has scored (`mark_scored`: a file in ``scored``),
    so: the others wait before 192 until PBT has scored ``last``'s 192 (it is scored alone: no copy
    at 192); ``last`` waits before 384 until PBT has scored the others' second point; the others wait,
    once their second point's report has gone out (a file in ``marks``), for the copy's run to start,
    so that they are not finished (out of PBT's ranking) when ``last`` reports 384, and so that the best
    one's latest report is the one with its second point's checkpoint (PBT's save of a top trial takes
    its latest report's checkpoint). The second point is 384, or the batch after it where the 384 save
    was postponed (the 192 one still uploading: `Checkpointer.postponed`; Tune's result waits for the save
    and goes out with it, so a wait at 384 itself held back the report it waited for: seen at load 11,
    the others' 384 scored only at 416, after a 120 s bound ran out). Each wait ends on its event alone.
    """

    def __init__(self, folder: str, marks: str, scored: str, last: dict, stop: str) -> None:
        self.folder, self.marks, self.scored, self.last, self.stop = folder, marks, scored, last, stop
        self.waited = False  # an other: its wait for the copy (once per fit)

    def _fits(self):
        out = []
        for name in os.listdir(self.folder):
            with open(os.path.join(self.folder, name)) as f:
                # Whole lines only: a trial may be writing its next line (one write, not atomic for a long one).
                lines = [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
            if lines:
                out.append((lines[0], lines[-1].get("sp", 0)))
        return out

    def _scored(self, mine: bool, sample: int) -> int:
        """How many trials (``last``'s if mine, else the others) PBT has scored at ``sample`` or later."""
        return len(scored_trials(self.scored, "last" if mine else "other", sample))

    def batch_start(self, state, logger) -> None:
        from raytrain_events.checkpoint.run.checkpointer import find_checkpointer

        loader = getattr(state.train_dataloader, "dataloader", state.train_dataloader)
        if loader.mixture.switches:
            return  # a copy
        sample, mine = state.timestamp.get_value("sp"), loader.mixture.stages["0dur"] == self.last
        if not mine and sample == 160:
            ready = lambda: self._scored(True, 192) >= 1  # noqa: E731
        elif mine and sample == 352:
            ready = lambda: self._scored(False, 384) >= 3  # noqa: E731
        elif not mine and sample >= 384 and not self.waited:
            checkpointer = find_checkpointer(state)
            if checkpointer.postponed or checkpointer.has_unreported():
                return  # the 384 save (and its report) not made yet: train on to it
            self.waited = True
            # Wait right after that report: PBT's save of a top trial takes the checkpoint of its latest report.
            with open(os.path.join(self.marks, f"at384-{uuid.uuid4().hex[:8]}"), "w"):
                pass
            ready = lambda: any(h["start"]["sp"] > 0 for h, _ in self._fits())  # noqa: E731
        else:
            return
        wait_until(ready, self.stop)


def scored_trials(folder: str, who: str, sample: int) -> set:
    """The trials (``who``: 'last' or 'other') whose result at ``sample`` or later `mark_scored` marked."""
    names = [name.split("-", 2) for name in os.listdir(folder) if name.startswith(who + "-")]
    return {trial for _, at, trial in names if int(at) >= sample}


def mark_scored(scheduler, folder: str, last: dict) -> None:
    """After PBT's ``on_trial_result`` (on the driver): a file in ``folder`` naming whose result at which sample
    it scored (``last-384-<trial id>``), what `CopyTheLast` waits for."""
    scored = scheduler.on_trial_result
    whose: dict = {}

    def on_trial_result(tune_controller, trial, result):
        # Whose trial it is, fixed at its first result (192, before any copy): a copy gives the last trial the
        # donor's config (at once, inside PBT's scoring of its 384, or before its copy's first result), and it
        # must not then be counted among the others.
        who = whose.setdefault(trial.trial_id, "last" if trial.config.get("mixture") == last else "other")
        decision = scored(tune_controller, trial, result)
        if "time/sample" in result:
            with open(os.path.join(folder, f"{who}-{int(result['time/sample'])}-{trial.trial_id}"), "w"):
                pass
        return decision

    scheduler.on_trial_result = on_trial_result


@pytest.mark.ray
@pytest.mark.slow
def test_a_mixture_pbt_sweep_copies_on_the_donors_mixture_and_position(ray_cluster, tmp_path):
    """4 trials on Dirichlet-drawn mixtures under PBT over the weights (one perturbation, at 384 of 512 samples).

    Every trial reports per-source samples and tokens adding up to its Timestamp and per-source
    eval loss; the bottom trial copies a top one: its run starts at the donor checkpoint's exact
    Timestamp on the donor's mixture switched there to the explored weights, and its rows continue
    the donor's (no row of the epoch twice; per-source counts continue the donor's).
    """
    from raytrain_events.checkpoint import CheckpointConfig
    from raytrain_events.tune import mixture_space, pbt_scheduler
    from raytrain_events.tune.simplex import normalize_weights, trial_mixture

    example = _example()
    samples = 512
    base = example.base_mixture(samples)
    space = mixture_space(base, num_samples=4, seed=0)
    fits, barrier, marks, scored = (tmp_path / name for name in ("fits", "barrier", "marks", "scored"))
    for folder in (fits, barrier, marks, scored):
        folder.mkdir()
    # The trial with the least 'help' is the worst on the held-out task at every report (measured: 0.80, 0.78,
    # 0.82 at 128, 256, 384 samples, against 0.49-0.66 for the others): it is the one PBT copies into.
    last = min(space["grid_search"], key=lambda w: w["help"])
    stop = str(tmp_path / "stop")  # written when the sweep ends: frees any wait a failed run left (`wait_until`)
    callbacks = [
        FitRows(str(fits)),
        StartTogether(str(barrier), 4, stop),
        CopyTheLast(str(fits), str(marks), str(scored), last, stop),
    ]
    # Reports, evals and checkpoints every 6 batches (192 samples): PBT scores the trials at 192 and 384; the final
    # report (512) is 128 after the last, under the interval, so no copy comes there (it would train no batch).
    scheduler = pbt_scheduler("160sp", mixture=mixture_space(base), seed=0, resample_probability=0.0)
    mark_scored(scheduler, str(scored), last)
    try:
        result = example.proxy_trials_on_ray(
            space,
            samples,
            str(tmp_path / "runs"),
            batch_size=32,
            scheduler=scheduler,
            report_interval="6ba",
            eval_interval="6ba",
            checkpoint=CheckpointConfig(save_interval="6ba"),
            callbacks=lambda config: callbacks,
            resources_per_worker={"CPU": 0.5},  # 4 trials' workers on 2 of the session's 4 CPUs: Ray Data reads beside
        )
    finally:
        open(stop, "w").close()
    assert len(result.rows) == 4 and {r["status"] for r in result.rows} == {"completed"}, result.to_table()
    # The scheduler marked what `CopyTheLast` waited for: last's 192, each other's second point (384, or the batch
    # its postponed save went out at) before its final report.
    marked = os.listdir(scored)
    assert sum(n.startswith("last-192-") for n in marked) == 1
    second = {n.split("-", 2)[2] for n in marked if n.startswith("other-") and 384 <= int(n.split("-")[1]) < samples}
    assert len(second) == 3, marked
    copied = [r for r in result.rows if r["lineage"]]
    own = [r for r in result.rows if not r["lineage"]]
    assert len(copied) == 1, result.to_table()  # PBT copied a top trial into the bottom one
    drawn = {tuple(sorted(w.items())) for w in space["grid_search"]}
    assert {tuple(sorted(r["config"]["mixture"].items())) for r in own} == drawn - {tuple(sorted(last.items()))}
    records = [[json.loads(line) for line in open(fits / name)] for name in sorted(os.listdir(fits))]
    first_fits = {Mixture.from_dict(r[0]["mixture"]) for r in records if r[0]["start"]["sp"] == 0}
    assert first_fits == {trial_mixture(base, w) for w in space["grid_search"]}  # each trial began on its draw
    for row in result.rows:
        counts = {n: row[f"mixture/samples/{n}"] for n in example.SOURCES}
        assert sum(counts.values()) == row["time/sample"] == samples
        assert sum(row[f"mixture/tokens/{n}"] for n in example.SOURCES) == row["time/token"] == samples * example.DIM
        if not row["lineage"]:
            weights = row["config"]["mixture"]
            for name in example.SOURCES:  # the plan apportions the epoch by the weights (largest remainders)
                assert abs(counts[name] - weights[name] / sum(weights.values()) * samples) <= 1
        evals = [e for e in result.histories[row["trial_id"]] if "metrics/eval_small/cross_entropy" in e]
        assert all(f"metrics/eval_{n}/cross_entropy" in evals[-1] for n in example.SOURCES)

    # The copy: the donor's exact Timestamp, the donor's mixture switched there, the donor's rows continued.
    row_of = {}
    for source in example.SOURCES:
        for i, r in enumerate(example.make_rows(source, example.ROWS, 0)):
            row_of[tuple(r["x"].tolist())] = (source, i)
    for row in copied:
        step = row["lineage"][-1]
        at, donor_counters = step["counters"]["sample"], step["counters"]
        assert 0 < at < samples and step["mixture"] == row["config"]["mixture"] != step["from_mixture"]
        donor_mixture = trial_mixture(base, step["from_mixture"])
        switched = donor_mixture.switched(at, normalize_weights(row["config"]["mixture"], base.names))
        expected = {
            "ep": donor_counters["epoch"],
            "ba": donor_counters["batch"],
            "sp": at,
            "tok": donor_counters["token"],
        }
        (copy,) = [r for r in records if r[0]["start"] == expected and Mixture.from_dict(r[0]["mixture"]) == switched]
        (donor,) = [
            r for r in records if r[0]["start"]["sp"] == 0 and Mixture.from_dict(r[0]["mixture"]) == donor_mixture
        ]
        before = [row_of[tuple(x)] for batch in donor[1:] if batch["sp"] <= at for x in batch["x"]]
        after = [row_of[tuple(x)] for batch in copy[1:] for x in batch["x"]]
        assert len(before) == at and len(after) == samples - at > 0
        assert len(set(before + after)) == samples  # no row of the epoch twice: each source went on from its cursor
        trained = {n: sum(1 for s, _ in before + after if s == n) for n in example.SOURCES}
        assert trained == {n: row[f"mixture/samples/{n}"] for n in example.SOURCES}  # the counts continued the donor's

    # Per-source eval loss means what it says, on the trials trained on their own draw (measured without PBT:
    # eval_small 0.324 and 0.328 for the two trials with most 'small', 0.628 and 0.661 for the two with almost
    # none; eval_help lowest, 0.421, for the most 'help').
    def eval_loss(row, source):
        key = f"metrics/eval_{source}/cross_entropy"
        return [e for e in result.histories[row["trial_id"]] if key in e][-1][key]

    def weight(row, source):
        return row["config"]["mixture"][source]

    much = [r for r in own if weight(r, "small") >= 0.5]
    little = [r for r in own if weight(r, "small") < 0.05]
    assert much and little
    assert max(eval_loss(r, "small") for r in much) < min(eval_loss(r, "small") for r in little) - 0.2
    by_help = sorted(own, key=lambda r: weight(r, "help"))
    assert min(own, key=lambda r: eval_loss(r, "help")) is by_help[-1]
    assert max(own, key=lambda r: eval_loss(r, "help")) is by_help[0]
    header = result.to_table().splitlines()[0].split()
    assert {"mixture/help", "mixture/small", "mixture/tokens/help", "mixture/tokens/small"} <= set(header)
