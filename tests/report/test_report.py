"""`raytrain-events report` on saved run and sweep directories (no Ray: the files a run leaves).

The run directory is built the way `RayTrainer` leaves one (config.yaml through RunDir,
history.jsonl through append_history, including a resumed second fit); the sweep directory holds
two trial folders with the records `sweep` writes. The real-run checks live in
tests/examples/test_console_report.py (the digits example) and tests/tune/ (a 2-trial sweep).
"""

from __future__ import annotations

import json
import os
import re

import pytest
from png_checks import check_png

from raytrain_events.cli.main import main
from raytrain_events.report import append_history, read_history, write_report
from raytrain_events.report.plots import SWEEP_SIZE, run_figures, spike_marks, spike_summary, throughput
from raytrain_events.storage.exp_dir import RunDir


def _entries(n, attempt=1, start_sample=0, t0=1000.0, tokens=False, metric=lambda i: 0.5 + 0.05 * i):
    out = []
    for i in range(1, n + 1):
        entry = {
            "time/epoch": i,
            "time/batch": 12 * i,
            "time/sample": start_sample + 750 * i,
            "time/token": 7500 * i if tokens else 0,
            "train/loss": 2.0 / i,
            "train/lr": 0.1 / i,
            "metrics/eval/accuracy": metric(i),
            "metrics/eval/cross_entropy": 1.0 / i,
            "attempt": attempt,
            "wall_time": t0 + 3.0 * i,
            "final": i == n,
            "world_size": 2,
        }
        if i % 2 == 0:
            entry["checkpoint_path"] = f"/runs/r/checkpoints/ckpt-{i:04d}"
        out.append(entry)
    return out


@pytest.fixture
def run_dir(tmp_path):
    run = str(tmp_path / "runs" / "r")
    RunDir(run, {}).save_config({"run_name": "r", "max_duration": "6ep", "config": {"lr": 0.1, "model": "mlp"}})
    append_history(run, _entries(4))
    # A resumed fit of the same run directory: its attempts are numbered after the first fit's.
    append_history(run, [dict(e, **{"time/epoch": e["time/epoch"] + 4}) for e in _entries(2, start_sample=3000)])
    return run


def test_history_file_appends_a_resumed_fit_with_later_attempts(run_dir):
    history = read_history(run_dir)
    assert len(history) == 6
    assert [e["attempt"] for e in history] == [1, 1, 1, 1, 2, 2]


def test_run_report_writes_html_and_pngs_it_references(run_dir):
    written = write_report(run_dir)
    assert written["kind"] == "run" and written["html"].endswith("report.html")
    html = open(os.path.join(run_dir, "report.html")).read()
    # loss + 2 eval metrics; the lr and throughput panels; no token plot (tokens were not counted).
    for name, panels in (("metrics.png", 3), ("learning_rate.png", 1), ("throughput.png", 1)):
        assert f'src="{name}"' in html
        check_png(os.path.join(run_dir, name), panels)
    assert not os.path.exists(os.path.join(run_dir, "metrics_tokens.png"))
    assert "<script" not in html and "http" not in html.replace("Written by", "")  # static, self-contained
    assert "ckpt-0004" in html and "model: mlp" in html  # checkpoints table and the run config
    assert re.search(r"attempts \(worker group starts\)</td><td>2<", html)


def test_throughput_leaves_out_an_interval_without_batches():
    """The end-of-run report right after the last periodic one ran no batch: no 0 samples/s point."""
    history = [
        {"attempt": 1, "wall_time": 0.0, "time/batch": 0, "time/sample": 0},
        {"attempt": 1, "wall_time": 10.0, "time/batch": 10, "time/sample": 1000},
        {"attempt": 1, "wall_time": 20.0, "time/batch": 20, "time/sample": 2000},
        {"attempt": 1, "wall_time": 21.0, "time/batch": 20, "time/sample": 2000, "final": True},
    ]
    assert throughput(history) == [(10.0, 100.0), (20.0, 100.0)]
    # A slow interval that did run batches stays in, however slow.
    slow = history[:3] + [{"attempt": 1, "wall_time": 120.0, "time/batch": 21, "time/sample": 2100}]
    assert throughput(slow)[-1] == (120.0, 1.0)


def test_run_report_plots_tokens_when_counted(tmp_path):
    run = str(tmp_path / "tok")
    append_history(run, _entries(3, tokens=True))
    write_report(run)
    check_png(os.path.join(run, "metrics_tokens.png"), 3)


def test_run_report_shows_tokens_seen_per_source(tmp_path):
    run = str(tmp_path / "mix")
    entries = _entries(2, tokens=True)
    entries[-1].update({"mixture/samples/web": 1200, "mixture/samples/code": 300})
    entries[-1].update({"mixture/tokens/web": 12000, "mixture/tokens/code": 3000})
    append_history(run, entries)
    write_report(run)
    with open(os.path.join(run, "report.html")) as fh:
        page = fh.read()
    section = page.split("<h2>Tokens seen per source</h2>", 1)[1].split("<h2>", 1)[0]
    assert ">web<" in section and ">12000<" in section and ">0.8<" in section and ">code<" in section


def test_run_report_marks_spikes_rollbacks_skipped_and_quarantined_rows_on_the_loss(tmp_path):
    """SpikeGuard's metrics (logged at each rollback, carried by every later report): a purple mark per
    rollback at the spike's global sample, the counts in the loss panel's title and the summary table."""
    entries = _entries(4)
    plain = run_figures(entries)["metrics"]
    entries[1].update({"spikes/rollbacks": 1, "spikes/last_sample": 1300, "spikes/skipped_samples": 16})
    for entry in entries[2:]:
        entry.update({"spikes/rollbacks": 2, "spikes/last_sample": 2900, "spikes/skipped_samples": 16})
        entry["spikes/quarantined_rows"] = 3
    assert spike_marks(entries) == [1300, 2900]  # the first report after each rollback, at its spike's sample
    assert spike_marks(entries, "time/token") == [0, 0]  # another axis: the report's own x
    assert spike_summary(entries) == "2 rollbacks, 16 rows skipped, 3 quarantined"
    assert spike_summary(_entries(2)) == ""
    assert run_figures(entries)["metrics"] != plain  # the marks and the title are drawn
    run = str(tmp_path / "spiky")
    append_history(run, entries)
    write_report(run)
    check_png(os.path.join(run, "metrics.png"), 3)
    page = open(os.path.join(run, "report.html")).read()
    assert "a spike rolled back" in page and re.search(r"spikes/quarantined_rows</td><td>3<", page)


def _trial(root, folder, label_algorithms, curve, lineage=None):
    os.makedirs(os.path.join(root, folder))
    record = {
        "run_url": os.path.join(root, folder, "train"),
        "history": _entries(4, metric=curve),
        "checkpoints": [os.path.join(root, folder, "train", "checkpoints", "ckpt-0004")],
        "config": {"algorithms": label_algorithms, "lr": 0.1},
        **({"lineage": lineage} if lineage is not None else {}),
    }
    with open(os.path.join(root, folder, "raytrain_trial.json"), "w") as fh:
        json.dump(record, fh)


def test_sweep_report_compares_trials_best_first(tmp_path, capsys):
    root = str(tmp_path / "sweep")
    _trial(root, "trial_a", [], lambda i: 0.5 + 0.05 * i)
    _trial(root, "trial_b", ["label_smoothing"], lambda i: 0.6 + 0.08 * i)
    with open(os.path.join(root, "sweep.json"), "w") as fh:
        json.dump({"metric": "metrics/eval/accuracy", "mode": "max"}, fh)

    assert main(["report", root]) == 0  # the CLI entry point
    assert "report.html" in capsys.readouterr().out
    html = open(os.path.join(root, "report.html")).read()
    assert 'src="sweep.png"' in html
    check_png(os.path.join(root, "sweep.png"), size=SWEEP_SIZE)
    # The table is sorted by the metric, best first and highlighted.
    assert html.index("trial_b") < html.index("trial_a")
    assert re.search(r'<tr class="best"><td>trial_b</td>', html)
    assert "Lineage" not in html  # no population-based training, no lineage section


def test_sweep_report_shows_each_copy_of_a_pbt_trial(tmp_path):
    root = str(tmp_path / "sweep")
    _trial(root, "trial_a", [], lambda i: 0.5 + 0.05 * i)
    copy = {
        "run_name": "from-trial_a-ckpt-0024",
        "copied_trial": "trial_a",
        "checkpoint": os.path.join(root, "trial_a", "train", "checkpoints", "ckpt-0024"),
        "counters": {"epoch": 2, "batch": 24, "sample": 1500, "token": 0},
        "from_algorithms": [],
        "algorithms": [{"name": "label_smoothing", "smoothing": 0.2}],
    }
    later = dict(copy, run_name="from-trial_a-ckpt-0036", counters={"epoch": 3, "batch": 36, "sample": 2250})
    _trial(root, "trial_b", ["label_smoothing"], lambda i: 0.6 + 0.08 * i, lineage=[copy, later])

    write_report(root)
    html = open(os.path.join(root, "report.html")).read()
    section = html[html.index("Lineage (population-based training)") :]
    cells = re.findall(r"<tr><td>(.*?)</td></tr>", section)
    assert cells == [
        "trial_b</td><td>trial_a</td><td>1500</td><td>24</td><td>none</td><td>label_smoothing(smoothing=0.2)"
        "</td><td>from-trial_a-ckpt-0024",
        "trial_b</td><td>trial_a</td><td>2250</td><td>36</td><td>none</td><td>label_smoothing(smoothing=0.2)"
        "</td><td>from-trial_a-ckpt-0036",
    ]


def test_report_on_a_folder_that_is_neither_says_what_it_needs(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "history.jsonl or config.yaml" in capsys.readouterr().err
