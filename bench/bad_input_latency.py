"""How long a user waits for the error of a bad `RayTrainer` input (issue 39): it must come before Ray starts.

The cases are ``tests/test_bad_input.py::RAY_TRAINER_CASES`` and (issue 48)
``tests/test_bad_input_ray.py::CASES``. One fresh Python process (no Ray
running) imports what a user's script imports anyway (torch, ray.data, raytrain_events), then
runs every case in order and times ``RayTrainer(**kwargs).fit()`` to its error; the first case
also pays the library's lazy imports (the ``RayTrainer`` driver and its checks), as a user's one
bad run would. ``ray.is_initialized()`` is checked after each error: it must stay False (the
error came before Ray started). The import time is printed too.

Usage::

    python bench/bad_input_latency.py            # a markdown table
    python bench/bad_input_latency.py --json     # also one JSON line per case
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    began = time.perf_counter()
    import ray
    import ray.data  # noqa: F401
    import torch  # noqa: F401

    import raytrain_events  # noqa: F401

    imports = time.perf_counter() - began
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_bad_input as cases

    from raytrain_events.ray.driver import RayTrainer

    print(f"imports (torch, ray.data, raytrain_events): {imports:.1f} s\n")
    print("| case | RayTrainer(...).fit() to the error | Ray started | error |")
    print("|---|---|---|---|")
    import test_bad_input_ray as round_three
    from bad_input_helpers import parquet_source

    folder = tempfile.mkdtemp()
    sources = {"web": parquet_source(f"{folder}/web.parquet", 40), "code": parquet_source(f"{folder}/code.parquet", 30)}
    all_cases = [(name, changes, error) for name, changes, error, _ in cases.RAY_TRAINER_CASES] + [
        (name, lambda changes=changes: changes(sources), error) for name, changes, error, _ in round_three.CASES
    ]
    for name, changes, error in all_cases:
        kwargs = cases._ray_kwargs(**{"storage_path": tempfile.mkdtemp(), **changes()})
        start = time.perf_counter()
        try:
            RayTrainer(**kwargs).fit()
        except error as exc:
            took = time.perf_counter() - start
            message = str(exc).replace("\n", " ").replace("|", "/")[:80]
            print(f"| {name} | {took * 1000:.0f} ms | {ray.is_initialized()} | {type(exc).__name__}: {message}... |")
            if args.json:
                print(json.dumps({"case": name, "to_error_s": took, "ray_started": ray.is_initialized()}))
        else:
            print(f"| {name} | no error | {ray.is_initialized()} | |")


if __name__ == "__main__":
    main()
