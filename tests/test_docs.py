"""The docs site builds with ``mkdocs build --strict``, and the docs name no issue numbers.

``--strict`` turns every warning into a failure: a link to a page or an anchor that does not
exist, a page under ``docs/`` left out of the nav, and an API reference (``::: name``) that
mkdocstrings cannot find. The pages' code blocks run in ``tests/test_readme.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_docs_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # as the README's docs command (docs/contributing.md)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # what the README's docs command prints: MkDocs' INFO lines only (no notice, no warning to ignore)
    printed = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert printed and all(line.startswith("INFO") for line in printed), printed
    assert (tmp_path / "site" / "index.html").exists()
    reference = (tmp_path / "site" / "reference" / "loop" / "index.html").read_text()
    for name in ["Trainer", "RayTrainer", "Time", "Timestamp", "Event", "CheckpointConfig"]:
        assert f'id="raytrain_events.{name}"' in reference, f"{name} is missing from the API reference"


def user_docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_user_docs_name_no_issue_numbers():
    found = []
    for path in user_docs():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bissues? \d+|(?<![\w`])#\d+\b", line, flags=re.I):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "say what changed and when, not which issue asked:\n" + "\n".join(found)


def test_readme_links_point_at_files_that_exist():
    for path in [ROOT / "README.md", ROOT / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to a missing {target}"
