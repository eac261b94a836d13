"""The test tree mirrors the package: each folder under ``tests/`` is a package or subpackage of
``raytrain_events`` (``tests/data/ray/`` tests ``raytrain_events/data/ray/``, ``tests/ray/fault_tolerance/``
tests ``raytrain_events/ray/fault_tolerance/``), so a reader finds a part's tests where the part lives.

A few folders test what is not a package; they are listed in `EXTRA_FOLDERS` with what they test. A top-level
module's tests (``raytrain_events/hf.py``: ``tests/test_library_hf.py``) sit in ``tests/`` itself, and so do helpers
shared by tests of several folders (``resume_helpers.py``, ``bad_input_helpers.py``, ``library_helpers.py``); a
helper used by one folder's tests sits in that folder.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List

TESTS = pathlib.Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "raytrain_events"

#: Top-level test folders that do not mirror a package, and what they test.
EXTRA_FOLDERS = {
    "examples": "the example scripts in examples/, run as a user runs them",
    "cluster": "the cluster launcher (cluster.yaml, ray up / submit / down) in namespaces",
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


# ------------------------------------------------------------------ imports inside functions
#: Packages whose in-function imports of the package's own modules each say why (a ``# why here:`` comment on
#: the import, or on the line above the run of imports it belongs to): breaking a cycle or deferring a heavy
#: dependency. Every package is here now; a new one joins when it is added.
WHY_CHECKED = (
    "core",
    "report",
    "storage",
    "checkpoint",
    "cli",
    "algorithms",
    "callbacks",
    "trainer",
    "parallel",
    "data",
    "tune",
    "ray",
    "schedulers",
    "loggers",
    ".",  # the top-level modules (models.py, __main__.py, ...)
)


def _comment_of(lines: List[str], node: ast.stmt) -> str:
    """The import's own lines and the comment line right above the run of imports it is part of."""
    first = node.lineno - 1
    while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
        first -= 1
    above = lines[first - 1].strip() if first > 0 else ""
    return " ".join([above if above.startswith("#") else ""] + lines[node.lineno - 1 : node.end_lineno])


def unexplained_function_imports(package: pathlib.Path = PACKAGE, subpackages=WHY_CHECKED) -> List[str]:
    """``file:line`` of each import of ``package``'s own modules inside a function with no ``why`` near it."""
    found = []
    for sub in subpackages:
        for path in sorted(package.glob("*.py") if sub == "." else (package / sub).rglob("*.py")):
            lines = path.read_text().splitlines()
            for func in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    own = (
                        isinstance(node, ast.ImportFrom)
                        and (node.level or (node.module or "").startswith(package.name))
                    ) or (
                        isinstance(node, ast.Import) and any(a.name.split(".")[0] == package.name for a in node.names)
                    )
                    if own and "why" not in _comment_of(lines, node):
                        found.append(f"{path.relative_to(package.parent).as_posix()}:{node.lineno}")
    return sorted(set(found), key=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])))


def test_imports_inside_functions_say_why():
    found = unexplained_function_imports()
    assert not found, (
        "an import of raytrain_events inside a function: move it to the module's top, or (to break a cycle or defer "
        "a heavy dependency) say so in a '# why here:' comment:\n" + "\n".join(found)
    )


def test_the_why_check_catches_a_silent_function_import(tmp_path):
    package = tmp_path / "raytrain_events"
    (package / "cli").mkdir(parents=True)
    (package / "cli" / "a.py").write_text(
        "def f():\n"
        "    from raytrain_events.cli import b\n"
        "def g():\n"
        "    # why here: imports torch\n"
        "    from raytrain_events.cli import c\n"
        "    from raytrain_events.cli import d\n"
        "def h():\n"
        "    import json\n"
        "    from raytrain_events.cli import e  # why here: a cycle\n"
        "    from raytrain_events.cli import f\n"
    )
    assert unexplained_function_imports(package, ("cli",)) == [
        "raytrain_events/cli/a.py:2",
        "raytrain_events/cli/a.py:10",
    ]
