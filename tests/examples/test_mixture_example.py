"""examples/mixture.py on the session's Ray: the 2-stage mixture of three pre-tokenized Parquet sources
trains one epoch on 2 workers, and the tokens seen per source it prints are the plan's.

One RayTrainer run in the session's Ray (the example's own ``run``; ``python examples/mixture.py``
would start a Ray of its own).
"""

from __future__ import annotations

import pytest

from tests.example_scripts import load_example

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _example():
    return load_example("mixture.py", "mixture_example")


def test_mixture_example_prints_the_plans_tokens_per_source(ray_cluster, tmp_path):
    from raytrain_events import Mixture

    example = _example()
    result = example.run(str(tmp_path / "data"), str(tmp_path / "runs"), workers=2)
    tokens = example.tokens_per_source(result)
    plan = Mixture(sources=example.SOURCES, stages=example.STAGES, epoch_size=1600).plan(
        seed=0, total_samples=1600, global_batch=32
    )
    assert tokens == {n: rows * (example.SEQ - 1) for n, rows in zip(plan.names, plan.epoch_totals(0))}
    assert sum(tokens.values()) == result.timestamp.token.value and result.timestamp.sample.value == 1600
    assert tokens["math"] == 400 * (example.SEQ - 1)  # 10% of the first 800 rows, 40% of the next 800
    # The line naming the run report comes only with the report it names (issue 48).
    line = example.report_line(result.run_url)
    written = sorted(str(p) for p in (tmp_path / "runs").rglob("report.html"))
    assert len(written) == 1 and line == f"run report: {written[0]}", (line, written)
