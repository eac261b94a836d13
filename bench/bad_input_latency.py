"""How long a user waits for the error of a bad `RayTrainer` input (issue 39): it must come before Ray starts.

Each case of ``tests/test_bad_input.py::RAY_TRAINER_CASES`` runs in a fresh Python process (nothing
imported, no Ray running), and two times are printed per case: from ``RayTrainer(...)`` (after the
imports a user's script makes anyway: torch, raytrain_events, ray.data) to the error, and the
whole process (interpreter start and imports included). ``ray.is_initialized()`` is checked after
each error (it must be False: the error came before Ray started).

Usage::

    python bench/bad_input_latency.py            # a markdown table
    python bench/bad_input_latency.py --json     # also one JSON line per case
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CASE = r"""
import sys, time, tempfile
sys.path.insert(0, {tests!r})
import torch, ray.data  # what a user's script imports anyway
import raytrain_events
from raytrain_events.ray.driver import RayTrainer
import test_bad_input as cases
import ray
(changes, error) = [(c[1], c[2]) for c in cases.RAY_TRAINER_CASES if c[0] == {name!r}][0]
kwargs = cases._ray_kwargs(**{{"storage_path": tempfile.mkdtemp(), **changes()}})
start = time.perf_counter()
try:
    RayTrainer(**kwargs).fit()
except error as exc:
    took = time.perf_counter() - start
    print("RESULT", took, ray.is_initialized(), type(exc).__name__, str(exc).replace("\n", " ")[:90])
else:
    print("RESULT none")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_bad_input

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    print("| case | RayTrainer(...).fit() to the error | whole process | Ray started | error |")
    print("|---|---|---|---|---|")
    for name, *_ in test_bad_input.RAY_TRAINER_CASES:
        code = _CASE.format(tests=os.path.join(ROOT, "tests"), name=name)
        began = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        whole = time.perf_counter() - began
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
        if line is None or line == "RESULT none":
            print(f"| {name} | no error | {whole:.1f} s | ? | {out.stderr.strip().splitlines()[-1:]} |")
            continue
        _, took, started, kind, message = line.split(" ", 4)
        print(f"| {name} | {float(took) * 1000:.0f} ms | {whole:.1f} s | {started} | {kind}: {message}... |")
        if args.json:
            print(json.dumps({"case": name, "to_error_s": float(took), "process_s": whole, "ray_started": started}))


if __name__ == "__main__":
    main()
