"""An import of the package's own modules inside a function says why, and the why holds (AST, no imports).

A function-level import hides an edge of the import graph from a reader (and from tools); it is kept only to

* break an import cycle: the imported module (or a package ``__init__`` on its way) imports this module at load
  time, so a module-level import would fail or see a half-built module; or
* defer a heavy dependency: the imported module loads, at load time, a library this module does not (``fsspec``,
  ``ray``, ``torch.distributed.checkpoint``...), and a caller that never runs the function is spared its import.

Each such import carries a ``# why here:`` comment, on its line or on the comment lines right above its block of
imports, that either says ``cycle`` or names the library it defers. The check works both claims out from the
source: a cycle must exist through module-level imports (parent packages included, as Python runs them); a named
library must be in what the imported module loads at load time and not in what this module loads already. An
import whose reason no longer holds moves to the top of its module.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import sys
from typing import Dict, List, Optional, Set, Tuple

from tests.test_ownership import PACKAGE, _modules, _rel, _tree, _type_only_ids

WHY = "why here:"
#: Libraries a module loads at load time that its import statements do not name: module -> (libraries, how).
DYNAMIC_LOADS = {
    "raytrain_events.ray._compat_worker_group": (
        {"ray", "ray.train"},
        "`ShardedTorchftConfig`'s base class is Ray Train's `TorchftConfig`, looked up in the _compat table",
    ),
}


def _lazy_names(path: pathlib.Path) -> Dict[str, str]:
    """A module's names loaded on first use (a PEP 562 ``__getattr__`` over a module-level table: a package's
    ``_LAZY`` name -> module, ``_torch_compat.NAMES`` name -> (module, attribute)): name -> the module it loads."""
    table: Dict[str, str] = {}
    for stmt in _tree(path).body:
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        value = getattr(stmt, "value", None)
        if not isinstance(value, ast.Dict) or not any(getattr(t, "id", "") in {"_LAZY", "NAMES"} for t in targets):
            continue
        for key, item in zip(value.keys, value.values):
            first = item.elts[0] if isinstance(item, ast.Tuple) and item.elts else item
            if isinstance(key, ast.Constant) and isinstance(first, ast.Constant) and isinstance(first.value, str):
                table[str(key.value)] = first.value
    return table


def _resolve(module: str, path: pathlib.Path, node: ast.AST, modules: Dict[str, pathlib.Path]) -> List[str]:
    """The dotted names an import statement needs: ``from a.b import c`` needs ``a.b.c`` when it is a module, else
    ``a.b`` (whose ``c`` it reads) and, when ``a.b`` loads ``c`` on first use, the module ``c`` comes from. (Python
    runs the packages on the way, ``a`` and ``a.b``, too, but a half-run package is enough to import a module
    from.)"""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    mod = node.module or ""
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
    lazy = _lazy_names(modules[mod]) if mod in modules else {}
    names = []
    for alias in node.names:
        if f"{mod}.{alias.name}" in modules:
            names.append(f"{mod}.{alias.name}")
        else:  # a name read from ``mod`` (and the module it loads, for a lazy one)
            names += [mod] + ([lazy[alias.name]] if alias.name in lazy else [])
    return names


def _owner(name: str, modules: Dict[str, pathlib.Path]) -> str:
    while name and name not in modules:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def _load_time_imports(tree: ast.Module) -> List[ast.stmt]:
    """The import statements a module runs when it is imported: module level and class bodies, inside ``if``,
    ``try`` and ``with``, never under ``if TYPE_CHECKING:`` and never in a function."""
    found: List[ast.stmt] = []

    def visit(body: List[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found.append(stmt)
            elif isinstance(stmt, ast.ClassDef):
                visit(stmt.body)
            elif isinstance(stmt, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                    visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, (ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, field, []) or [])
                for handler in getattr(stmt, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


@functools.cache
def load_time_graph(
    package: pathlib.Path = PACKAGE,
) -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]], Dict[str, Set[str]]]:
    """Per module, at load time: the package's modules its import statements need (`_resolve`: the edges of an
    import cycle); those and the packages Python runs on the way (``import a.b.c`` runs ``a/__init__`` and
    ``a/b/__init__``; a module's own packages run before it): what importing it loads; and the other libraries
    its import statements load (each with its parents: ``torch.distributed.checkpoint`` counts
    ``torch.distributed`` and ``torch`` too)."""
    modules = _modules(package)
    root = package.name
    needs: Dict[str, Set[str]] = {}
    runs: Dict[str, Set[str]] = {}
    other: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        needs[module], runs[module], other[module] = set(), set(), set()
        runs[module].update(p for p in _prefixes(module) if p in modules)
        for stmt in _load_time_imports(_tree(path)):
            for name in _resolve(module, path, stmt, modules):
                if name.split(".")[0] == root:
                    needs[module].add(_owner(name, modules))
                    runs[module].update(o for o in (_owner(p, modules) for p in _prefixes(name)) if o)
                else:
                    other[module].update(_prefixes(name))
        other[module].update(*(_prefixes(n) for n in DYNAMIC_LOADS.get(module, ((), ""))[0]))
        for graph in (needs, runs):
            graph[module] -= {module, ""}
    return needs, runs, other


def _prefixes(name: str) -> Set[str]:
    pieces = name.split(".")
    return {".".join(pieces[:i]) for i in range(1, len(pieces) + 1)}


def _reach(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen: Set[str] = {start}
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def loads(package: pathlib.Path, module: str) -> Set[str]:
    """The other libraries importing ``module`` loads, through every module it loads at load time."""
    _, runs, other = load_time_graph(package)
    return set().union(*(other.get(m, set()) for m in _reach(runs, module)))


def _why(lines: List[str], node: ast.stmt, import_lines: Set[int]) -> Optional[str]:
    """The ``# why here:`` text on the import's lines, or on the comment lines above its block of imports."""
    for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        if WHY in lines[number - 1]:
            return lines[number - 1].split(WHY, 1)[1].strip()
    number = node.lineno - 1
    while number >= 1:
        text = lines[number - 1].strip()
        if text.startswith("#"):
            if WHY in text:
                return text.split(WHY, 1)[1].strip()
        elif number not in import_lines:
            return None
        number -= 1
    return None


def function_imports(package: pathlib.Path = PACKAGE) -> List[Tuple[str, int, str, Set[str], Set[str], Optional[str]]]:
    """``(file, line, importer, modules, libraries, why)`` for each import statement inside a function that loads
    the package's own modules: the package's modules it names, the other libraries it names (a lazy name's module:
    ``from raytrain_events._torch_compat import FsspecReader`` loads ``torch.distributed.checkpoint...``), and its
    ``# why here:`` text."""
    modules = _modules(package)
    found = []
    for module, path in modules.items():
        tree = _tree(path)
        lines = path.read_text().splitlines()
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        import_lines = {i for n in imports for i in range(n.lineno, (n.end_lineno or n.lineno) + 1)}
        at_load = {id(n) for n in _load_time_imports(tree)}
        type_only = _type_only_ids(tree)
        for node in imports:
            if id(node) in at_load or id(node) in type_only:  # the rest sit in functions
                continue
            names = _resolve(module, path, node, modules)
            own = {_owner(n, modules) for n in names if n.split(".")[0] == package.name} - {"", module}
            other = {n for n in names if n.split(".")[0] != package.name}
            if own:
                found.append((_rel(package, path), node.lineno, module, own, other, _why(lines, node, import_lines)))
    return found


def unexplained_function_imports(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: imported: problem`` for each function-level import of the package's own modules whose
    ``# why here:`` is missing or does not hold (no such cycle; no named library it defers)."""
    needs, runs, _ = load_time_graph(package)
    hits = []
    for rel, line, importer, own, other, why in function_imports(package):
        fresh = own - _reach(runs, importer)  # loaded already when the function runs
        where = f"{rel}:{line}: {', '.join(sorted(fresh or own))}"
        if why is None:
            hits.append(f"{where}: no '# {WHY}' (an import cycle it breaks, or the library it defers)")
        elif "cycle" in why:
            if not any(importer in _reach(needs, target) for target in own):
                hits.append(f"{where}: says it breaks a cycle, but none of them imports {importer} at load time")
        else:
            named = {n for o in other for n in _prefixes(o)}
            added = set().union(named, *(loads(package, t) for t in fresh)) - loads(package, importer)
            said = set(re.findall(r"[A-Za-z_][\w.]*\w", why))
            if not said & added:
                shown = sorted(a for a in added if "." not in a and a not in sys.stdlib_module_names) or ["nothing"]
                hits.append(f"{where}: '{why}' names no library it defers (importing it here adds: {', '.join(shown)})")
    return sorted(hits)


def test_each_function_level_import_of_the_package_says_why_and_the_why_holds():
    hits = unexplained_function_imports()
    assert not hits, (
        "A function-level import of raytrain_events breaks a load-time import cycle or defers a library the module "
        "does not load already ('# why here: ...' naming it); move the others to the top of the module:\n"
        + "\n".join(hits)
    )


def test_the_function_import_check_catches_each_false_why(tmp_path):
    pkg = tmp_path / "raytrain_events"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""x"""\n')
    (pkg / "sub" / "__init__.py").write_text('"""x"""\n_LAZY = {"Lazy": "raytrain_events.sub.heavy"}\n')
    (pkg / "sub" / "heavy.py").write_text("import fsspec\nimport torch.distributed.checkpoint as dcp\n")
    (pkg / "sub" / "light.py").write_text("import torch\n")
    (pkg / "sub" / "back.py").write_text("from raytrain_events.sub import uses\n")
    (pkg / "sub" / "uses.py").write_text(
        "import torch\n"
        "def ok():\n"
        "    # why here: defers fsspec until a save\n"
        "    from raytrain_events.sub import heavy\n"
        "    from raytrain_events.sub.heavy import dcp  # (the same block as the line above)\n"
        "    from raytrain_events.sub import Lazy  # why here: defers torch.distributed.checkpoint\n"
        "def ok_cycle():\n"
        "    from raytrain_events.sub import back  # why here: back imports this module (an import cycle)\n"
        "def silent():\n"
        "    from raytrain_events.sub import heavy\n"
        "def wrong_library():\n"
        "    from raytrain_events.sub import heavy  # why here: defers torch (loaded above already)\n"
        "def no_cycle():\n"
        "    from raytrain_events.sub import light  # why here: an import cycle\n"
        "def nothing_heavy():\n"
        "    from raytrain_events.sub import light  # why here: defers torch\n"
    )
    hits = [h.split(": ", 1)[1] for h in unexplained_function_imports(pkg)]
    assert len(hits) == 4, hits
    assert "raytrain_events.sub.heavy: no '# why here:' (an import cycle it breaks, or the library it defers)" in hits
    assert (
        "raytrain_events.sub.heavy: 'defers torch (loaded above already)' names no library it defers "
        "(importing it here adds: fsspec)" in hits
    )
    assert (
        "raytrain_events.sub.light: says it breaks a cycle, but none of them imports raytrain_events.sub.uses at load time"
        in hits
    )
    assert (
        "raytrain_events.sub.light: 'defers torch' names no library it defers (importing it here adds: nothing)" in hits
    )
    # the precise name of a submodule counts; its parent does not when the importer loads it already
    assert "torch.distributed.checkpoint" in loads(pkg, "raytrain_events.sub.heavy")
