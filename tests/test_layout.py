"""The test tree mirrors the package: each folder under ``tests/`` is a package or subpackage of
``raytrain_events`` (``tests/data/ray/`` tests ``raytrain_events/data/ray/``, ``tests/ray/fault_tolerance/``
tests ``raytrain_events/ray/fault_tolerance/``), so a reader finds a part's tests where the part lives.

A few folders test what is not a package; they are listed in `EXTRA_FOLDERS` with what they test. Helpers
shared by tests of several folders (``resume_helpers.py``, ``bad_input_helpers.py``) sit in ``tests/``
itself; a helper used by one folder's tests sits in that folder.
"""

from __future__ import annotations

import pathlib
from typing import List

TESTS = pathlib.Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "raytrain_events"

#: Top-level test folders that do not mirror a package, and what they test.
EXTRA_FOLDERS = {
    "examples": "the example scripts in examples/, run as a user runs them",
    "cluster": "the cluster launcher (cluster.yaml, ray up / submit / down) in namespaces",
    "library": "the Composer-style library: algorithms/, callbacks/, loggers/, schedulers/ through the Trainer",
}


def unmirrored_folders(tests: pathlib.Path = TESTS, package: pathlib.Path = PACKAGE) -> List[str]:
    """Folders under ``tests`` (any depth) whose path is not a package under ``package`` nor in or under an
    `EXTRA_FOLDERS` folder."""
    found = []
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir()):
        rel = folder.relative_to(tests)
        if rel.parts[0] in EXTRA_FOLDERS or any(part.startswith((".", "__")) for part in rel.parts):
            continue
        if not (package.joinpath(*rel.parts) / "__init__.py").is_file():
            found.append(rel.as_posix())
    return found


def test_each_test_folder_mirrors_a_package():
    found = unmirrored_folders()
    assert not found, (
        "each tests/ folder is a package of raytrain_events (tests/data/ray/ -> raytrain_events/data/ray/); "
        "move these tests to the folder of the package they test, or list the folder in EXTRA_FOLDERS "
        "with what it tests:\n" + "\n".join(found)
    )


def test_the_extra_folders_exist_and_mirror_nothing():
    for name in EXTRA_FOLDERS:
        assert (TESTS / name).is_dir(), f"tests/{name} is gone: drop it from EXTRA_FOLDERS"
        assert not (PACKAGE / name / "__init__.py").is_file(), f"raytrain_events/{name} is a package now"


def test_the_layout_check_catches_a_folder_without_a_package(tmp_path):
    package, tests = tmp_path / "raytrain_events", tmp_path / "tests"
    for sub in ("data", "data/ray", "ray"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text('"""x"""\n')
    for sub in ("data/ray", "ray/fault_tolerance", "examples/more", "ray/__pycache__", "misc"):
        (tests / sub).mkdir(parents=True)
    assert unmirrored_folders(tests, package) == ["misc", "ray/fault_tolerance"]
