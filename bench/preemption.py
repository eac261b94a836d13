"""Notice-to-commit of a SIGTERM on the example job (``examples/train.py``, 2 CPU workers by default).

Starts the example in a subprocess (its own embedded Ray), waits until it has trained for
``--after`` seconds, sends SIGTERM to one of *its* Ray Train worker processes (found among the
subprocess's descendants, never another Ray on the machine), and prints the record the
preemption guard wrote (``<run>/preemptions/batch-<N>.json``): the time from the signal to the
next batch boundary, to the committed checkpoint, and the save's share. Compare against the
step time (the floor: a notice waits for the batch in flight) printed from the run's history.

    python bench/preemption.py                      # 2 workers, MLP
    python bench/preemption.py --model cnn --after 40 --repeat 3

Grows with model size as: step time (<= one batch to the boundary) + staging the state to host
memory (bytes / memcpy bandwidth; async saves block only for this) + writing and committing
(bytes per rank / storage bandwidth). See README "Operating long runs".
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def _workers(pid: int) -> list:
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(child.cmdline()) or "RayTrainWorker" in child.name():
                found.append(child)
        except psutil.Error:
            continue
    return found


def run_once(args: argparse.Namespace, root: str, index: int) -> dict:
    run = f"preempt-{index}"
    storage = os.path.join(root, "runs")
    command = [
        sys.executable,
        os.path.join(os.path.dirname(__file__), "..", "examples", "train.py"),
        f"num_workers={args.workers}",
        f"model={args.model}",
        "max_duration=100ep",
        f"storage={storage}",
        f"run_name={run}",
        "progress_bar=false",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    history = os.path.join(storage, run, "history.jsonl")
    try:
        deadline = time.monotonic() + args.timeout
        while not glob.glob(os.path.join(storage, run, "checkpoints", "*")):  # training, one save done
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the example ended or stalled before training: {proc.stderr.read()[-2000:]}")
            time.sleep(1.0)
        time.sleep(args.after)
        workers = _workers(proc.pid)
        if not workers:
            raise RuntimeError("found no RayTrainWorker process under the example")
        sent = time.time()
        workers[-1].send_signal(signal.SIGTERM)
        proc.wait(timeout=args.timeout)
        records = sorted(glob.glob(os.path.join(storage, run, "preemptions", "*.json")))
        if not records:
            raise RuntimeError(f"no preemption record; the example said: {proc.stderr.read()[-2000:]}")
        record = json.load(open(records[-1]))
        record["signal_sent_to_record_s"] = round(record["wall"] - sent, 3)
        record["exit_code"] = proc.returncode
        record["step_s"] = _step_seconds(history)
        return record
    finally:
        if proc.poll() is None:
            proc.kill()


def _step_seconds(history: str) -> float:
    """Median seconds per global batch between reports (the history the driver saved)."""
    import statistics

    try:
        entries = [json.loads(line) for line in open(history) if line.strip()]
    except OSError:
        return float("nan")
    points = [(e["wall_time"], e["time/batch"]) for e in entries if "wall_time" in e]
    slopes = [(w2 - w1) / (b2 - b1) for (w1, b1), (w2, b2) in zip(points, points[1:]) if b2 > b1]
    return round(statistics.median(slopes), 4) if slopes else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="mlp", help="the example's model: mlp or cnn")
    parser.add_argument("--after", type=float, default=15.0, help="seconds of training before the SIGTERM")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeat):
            r = run_once(args, root, i)
            print(
                f"run {i}: {r['cause']} on rank {r['rank']} -> checkpoint {r['checkpoint']} at batch "
                f"{r['saved_batch']}: notice->boundary {r['notice_to_agreed_s']:.3f} s, save+commit "
                f"{r['save_s']:.3f} s, notice->commit {r['notice_to_commit_s']:.3f} s "
                f"(step {r['step_s']} s; example exit code {r['exit_code']})"
            )


if __name__ == "__main__":
    main()
