"""`RunSpec` is frozen and in sections: each run option decided once, where the spec is built.

Over the source (AST, no imports, like tests/test_ownership.py, whose helpers it uses):

* `RunSpec`'s own fields (ray/spec.py) are the factories and the sections; a run-level option
  declared flat on `RunSpec` fails (it goes in its section, ray/spec_sections.py). The loop's
  options are inherited from `LoopOptions` (trainer/options.py).
* `RunSpec`, `LoopOptions` and every section are ``frozen=True`` dataclasses, and no module assigns to a
  spec's attribute (``spec.x = ...``, ``self.spec.data.x += ...``, ``setattr(spec, ...)``,
  ``object.__setattr__(spec, ...)``) or reads one by name (``getattr(spec, "default_run_name", False)``).

And at run time: the flat `RayTrainer` keywords are the loop's, the factories and the sections'
options, each once; assigning to a spec or a section raises.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from typing import List

import pytest

from tests.test_ownership import PACKAGE, _modules, _rel, _tree

#: `RunSpec`'s own fields besides the sections: the factories each worker calls (what to train).
SPEC_OWN_FIELDS = {"model", "optimizers", "schedulers", "algorithms", "callbacks"}
#: The frozen dataclasses that hold a run's options: file -> class names.
FROZEN = {
    "ray/spec.py": {"RunSpec"},
    "trainer/options.py": {"LoopOptions"},
    "ray/spec_sections.py": {
        "DataOptions",
        "ScalingOptions",
        "StorageOptions",
        "CheckpointOptions",
        "ReportOptions",
        "FailureOptions",
    },
}
SECTIONS = {"data", "scaling", "storage", "checkpoints", "reports", "failures"}
_SPEC_NAME = re.compile(r"(^|_)spec$")  # spec, worker_spec, base_spec, self.spec


def _is_frozen_dataclass(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "id", getattr(deco.func, "attr", "")) == "dataclass":
            return any(k.arg == "frozen" and getattr(k.value, "value", False) is True for k in deco.keywords)
    return False


def flat_run_options(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: name`` for each `RunSpec` field that is neither a factory nor a section (``_section(...)``),
    and each class of `FROZEN` that is not a ``frozen=True`` dataclass."""
    hits = []
    for rel, names in FROZEN.items():
        path = package / rel
        classes = {n.name: n for n in _tree(path).body if isinstance(n, ast.ClassDef)} if path.exists() else {}
        for name in sorted(names):
            node = classes.get(name)
            if node is None or not _is_frozen_dataclass(node):
                hits.append(f"{rel}: {name} is not a frozen dataclass")
            if name != "RunSpec" or node is None:
                continue
            for stmt in node.body:
                if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                    continue
                section = isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", "") == "_section"
                if not section and stmt.target.id not in SPEC_OWN_FIELDS:
                    hits.append(f"{rel}:{stmt.lineno}: {stmt.target.id} (a run option: declare it in its section)")
    return hits


def _names_a_spec(node: ast.AST) -> bool:
    """Whether ``node`` is a spec or a part of one: ``spec``, ``self.spec``, ``worker_spec.data``."""
    while isinstance(node, ast.Attribute):
        if _SPEC_NAME.search(node.attr):
            return True
        node = node.value
    return isinstance(node, ast.Name) and bool(_SPEC_NAME.search(node.id))


def spec_mutations(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: text`` for each assignment to an attribute of a spec, or ``setattr``/``__setattr__`` on one."""
    hits = []
    for path in _modules(package).values():
        for node in ast.walk(_tree(path)):
            targets: List[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _names_a_spec(target.value):
                    hits.append(f"{_rel(package, path)}:{node.lineno}: {ast.unparse(target)} = ...")
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                setter = getattr(func, "id", None) == "setattr" or getattr(func, "attr", None) == "__setattr__"
                if setter and _names_a_spec(node.args[0]):
                    hits.append(f"{_rel(package, path)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def spec_module_imports(tree: ast.AST) -> List[str]:
    """Every module a module's source imports, at any level (tests/core/test_imports.py's rule for the spec)."""
    out: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def _is_spec_or_section(node: ast.AST) -> bool:
    """Whether ``node`` is a spec (``spec``, ``self.spec``) or one of its sections (``spec.storage``)."""
    if isinstance(node, ast.Name):
        return bool(_SPEC_NAME.search(node.id))
    if isinstance(node, ast.Attribute):
        return bool(_SPEC_NAME.search(node.attr)) or (node.attr in SECTIONS and _is_spec_or_section(node.value))
    return False


def spec_getattrs(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: text`` for each ``getattr(spec, "name", ...)``: a spec's values are its fields, read as such."""
    hits = []
    for path in _modules(package).values():
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("getattr", "hasattr")
                and len(node.args) >= 2
                and _is_spec_or_section(node.args[0])
                and isinstance(node.args[1], ast.Constant)
            ):
                hits.append(f"{_rel(package, path)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_run_spec_holds_its_run_options_in_frozen_sections():
    hits = flat_run_options()
    assert not hits, (
        "RunSpec's run-level options live in frozen sections (ray/spec_sections.py: data, scaling, storage, "
        "checkpoints, reports, failures); RayTrainer(**options) stays flat by itself:\n" + "\n".join(hits)
    )


def test_no_module_changes_a_spec():
    hits = spec_mutations()
    assert not hits, (
        "A RunSpec is built once (its sections' of()) and never changed: make the value where the spec is built, "
        "or use spec.replace(...) for a new one:\n" + "\n".join(hits)
    )


def test_a_spec_is_read_through_its_fields():
    hits = spec_getattrs()
    assert not hits, "Read a spec's field as spec.<section>.<name> (every value is a field):\n" + "\n".join(hits)


def test_the_spec_scans_catch_a_flat_option_and_a_mutation(tmp_path):
    pkg = tmp_path / "raytrain_events"
    for rel in FROZEN:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
    (pkg / "ray" / "spec.py").write_text(
        "@dataclass(frozen=True, kw_only=True)\n"
        "class RunSpec(LoopOptions):\n"
        "    model: Factory = _opt(help='m')\n"
        "    data: DataOptions = _section(DataOptions)\n"
        "    batch_size: int = _opt(64, help='rows')\n"
    )
    (pkg / "trainer" / "options.py").write_text("@dataclass(kw_only=True)\nclass LoopOptions:\n    x: int = 1\n")
    (pkg / "ray" / "spec_sections.py").write_text("")
    (pkg / "ray" / "driver.py").write_text(
        "def f(self, spec, worker_spec):\n"
        "    spec.num_workers = tuple(spec.num_workers)\n"
        "    self.spec.data.batch_size += 1\n"
        "    object.__setattr__(worker_spec, 'run_name', 'x')\n"
        "    setattr(spec.storage, 'run_name', 'y')\n"
        "    self.spec = spec\n"
        "    self.options.x = 1\n"
        "    return getattr(spec, 'default_run_name', False), getattr(spec, name), getattr(spec.data.mixture, 'x')\n"
        "    return hasattr(self.spec.storage, 'default_run_name')\n"
    )
    flat = flat_run_options(pkg)
    assert "ray/spec.py:5: batch_size (a run option: declare it in its section)" in flat
    assert "trainer/options.py: LoopOptions is not a frozen dataclass" in flat
    assert "ray/spec_sections.py: DataOptions is not a frozen dataclass" in flat and len(flat) == 8
    assert [h.split(": ", 1)[1] for h in spec_mutations(pkg)] == [
        "spec.num_workers = ...",
        "self.spec.data.batch_size = ...",
        "object.__setattr__(worker_spec, 'run_name', 'x')",
        "setattr(spec.storage, 'run_name', 'y')",
    ]
    assert sorted(h.split(": ", 1)[1] for h in spec_getattrs(pkg)) == [
        "getattr(spec, 'default_run_name', False)",
        "hasattr(self.spec.storage, 'default_run_name')",
    ]


def test_the_flat_options_are_the_loops_the_factories_and_the_sections_each_once():
    from raytrain_events.ray.spec import RunSpec, option_names
    from raytrain_events.ray.spec_sections import option_fields
    from raytrain_events.trainer.options import loop_option_names

    sections = {f.name: f.metadata["section"] for f in dataclasses.fields(RunSpec) if "section" in f.metadata}
    assert set(sections) == SECTIONS
    own = {f.name for f in dataclasses.fields(RunSpec)} - set(loop_option_names()) - set(sections)
    assert own == SPEC_OWN_FIELDS
    names = option_names()
    assert len(names) == len(set(names))  # one option, one place
    expected = loop_option_names() + sorted(SPEC_OWN_FIELDS, key=names.index)
    expected += [g.name for cls in sections.values() for g in option_fields(cls)]
    assert names == expected
    derived = {g.name for cls in sections.values() for g in dataclasses.fields(cls)} - set(names)
    assert derived == {"default_run_name"}  # a section's value made by its of(), not an option


def test_a_spec_and_its_sections_cannot_be_changed(tmp_path):
    from raytrain_events.ray.spec import RunSpec

    spec = RunSpec(
        model=print, optimizers=print, datasets={"train": None}, max_duration="1ep", storage_path=str(tmp_path)
    )
    for target, name in ((spec, "seed"), (spec, "data"), (spec.data, "batch_size"), (spec.storage, "run_name")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, None)
    assert spec.storage.default_run_name and spec.storage.run_name.startswith("run-")
    kept = spec.replace(batch_size=8)  # a section no change touches is kept as it was made
    assert kept.storage is spec.storage and kept.data.batch_size == 8 and spec.data.batch_size == 64
    named = spec.replace(run_name="mine")
    assert named.storage.run_name == "mine" and not named.storage.default_run_name
    assert dataclasses.replace(spec, batch_size=4).data.batch_size == 4  # the same path as spec.replace
