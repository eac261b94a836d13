"""Every ```python block of the README and of the docs site's pages runs, in order, as one script.

The order is the README's blocks, then each page's in the site's nav order (``mkdocs.yml``), so a
block may use what an earlier one defined; a block identical to an earlier one (the README's
example is also on the getting-started page) runs once. A sketch that cannot run goes in a fence
without a language.

The script is a fresh Python process, as a user's would be, but it joins the test session's Ray
(``RAY_ADDRESS`` set to the ``ray_cluster`` fixture's address, the way the docs and the examples
run on a running cluster) instead of starting an embedded instance of its own: that start-up was
most of this test's time. Starting an embedded instance (`ensure_ray` with no Ray running) is what
the shared ``examples/train.py`` run checks (tests/examples/conftest.py). The blocks start two
Ray Train runs (the ``RayTrainer`` page's fit and the Tune page's 2-trial sweep), about 35 CPU-s
each: a new block that starts one costs the whole suite that much, so prefer Ray-free blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TEST_COMMAND = (
    'pip install -c constraints.txt -e ".[test,examples]" && ruff check . && ruff format --check . && mypy'
    " && python -m pytest -q"
)


def nav_pages() -> list[Path]:
    """The site's pages in nav order (``mkdocs.yml``)."""

    def walk(item) -> list[str]:
        if isinstance(item, str):
            return [item]
        if isinstance(item, list):
            return [page for entry in item for page in walk(entry)]
        return [page for value in item.values() for page in walk(value)]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [DOCS / page for page in walk(nav)]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def all_python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every block, README first, then the pages in nav order; duplicates once."""
    blocks: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path in [README, *nav_pages()]:
        for code in python_blocks(path):
            if code not in seen:
                seen.add(code)
                blocks.append((str(path.relative_to(ROOT)), code))
    return blocks


def test_readme_has_the_two_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in text, "README's test command changed: keep it and .ci/run identical"
    assert TEST_COMMAND in ci, ".ci/run must run exactly the README's test command"
    assert "python examples/train.py" in text
    started = (DOCS / "getting-started.md").read_text()
    assert (
        TEST_COMMAND in started
        and 'pip install -c constraints.txt -e ".[examples]" && python examples/train.py' in started
    )


def test_every_page_is_in_the_nav_and_the_blocks_are_collected_from_all_of_them():
    pages = nav_pages()
    on_disk = sorted(DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "each docs/ page has one line in mkdocs.yml's nav, and each nav line a page"
    where = {w for w, _ in all_python_blocks()}
    # The pages whose examples are runnable: a page moved or renamed must keep its blocks running.
    for page in [
        "README.md",
        "docs/concepts/time.md",
        "docs/concepts/trainer.md",
        "docs/ray/index.md",
        "docs/checkpoints.md",
        "docs/tune.md",
        "docs/big-models.md",
    ]:
        assert page in where, page


@pytest.mark.slow
@pytest.mark.ray
def test_readme_python_blocks_run(ray_cluster, tmp_path):
    blocks = all_python_blocks()
    assert len(blocks) >= 8
    script = tmp_path / "docs_blocks.py"
    address = ray_cluster.get_runtime_context().gcs_address
    # After the docs' code (and not part of it): the blocks ran on the session's Ray, not on an
    # embedded instance of their own.
    check = f"import ray\nassert ray.get_runtime_context().gcs_address == {address!r}, ray.get_runtime_context()\n"
    script.write_text("\n\n".join([*(f"# --- {where}\n{code}" for where, code in blocks), check]))
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_DATA_DISABLE_PROGRESS_BARS="1",
        RAY_ADDRESS=address,  # the session's Ray: the blocks' RayTrainer and sweep connect to it
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_readme_table_matches_what_ships():
    import raytrain_events.callbacks as callbacks
    import raytrain_events.loggers as loggers
    import raytrain_events.schedulers as schedulers
    from raytrain_events.algorithms import available_algorithms, build_algorithm

    text = (DOCS / "concepts" / "what-ships.md").read_text()
    for name in available_algorithms():
        assert f"`{type(build_algorithm(name)).__name__}` (`{name}`)" in text, name
    shipped = [n for n in callbacks.__all__ if n[0].isupper() and not n.endswith("Error")]
    shipped += [n for n in loggers.__all__ if n.endswith("Logger")]
    shipped += [n for n in schedulers.__all__ if n.endswith("Scheduler") and n != "Scheduler"]
    missing = [n for n in shipped if f"`{n}`" not in text]
    assert not missing, missing
