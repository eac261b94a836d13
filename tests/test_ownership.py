"""One owner per decision, checked over the package's source (AST, no imports, no Ray).

* Only ``storage/run_dir.py`` (`RunDir`) spells the names in a run directory: a name literal
  anywhere else (``"config.yaml"``, ``"summary.json"``, the history, index and state files, a
  ``.../checkpoints/...`` path built by hand) fails.
* Only ``checkpoint/folder/folder.py`` (`CheckpointFolder`) deletes a checkpoint: a delete call in any
  other module fails, except the storage primitives themselves and the lock files' owner.
* No import cycle among the package's modules (function-level imports count: they hide a cycle,
  they do not remove it), except the allowlisted type-only edges below.
* Each package's docstring lists its files and its subpackages.

Each check is a function over a package directory, so ``python -c`` can point it at another
checkout (e.g. main's) to see what it catches there.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "raytrain_events"

#: File names in a run directory (and a checkpoint/sweep directory) that only `RunDir` spells.
RUN_FILE_NAMES = {
    "config.yaml",
    "summary.json",
    "history.jsonl",
    "report.html",
    "index.json",
    "state.pt",
    "sweep.json",
    "raytrain_trial.json",
    "hang.json",
}
#: Folder names in a run directory: a literal used as a path piece (a call argument, an f-string, a
#: concatenation, a constant's definition) is flagged; as a JSON field ({"checkpoints": ...},
#: ``record.get("checkpoints")``) it is not.
RUN_DIR_NAMES = {"checkpoints", "hangs", "preemptions"}
RUN_DIR_OWNER = "storage/run_dir.py"

#: Calls that delete from storage. Allowed only in the checkpoint folder's owner and, for files that are
#: not checkpoints, the storage primitives (fs.py: temp files of atomic writes) and the lock files' owner.
DELETE_CALLS = {"delete", "rm", "rm_file", "rmdir", "rmtree", "unlink", "delete_checkpoint", "_rm"}
DELETE_ALLOWED = {
    "checkpoint/folder/folder.py": "the owner of every checkpoint deletion (CheckpointFolder)",
    "storage/fs.py": "defines delete(); unlinks the temp file of a failed atomic write",
    "storage/locks.py": "deletes lock files (running/scheduled/ckpt), never a checkpoint",
}

#: Import edges allowed inside a cycle: type-only (under ``if TYPE_CHECKING:``), Composer's vocabulary, where
#: a callback's and an algorithm's hooks are typed with the `State` that holds them; a mixture's plan typed with
#: the `Mixture` it plans (``Mixture.plan`` builds it).
CYCLE_ALLOWED = {
    ("raytrain_events.core.callback", "raytrain_events.core.state"),
    ("raytrain_events.core.algorithm", "raytrain_events.core.state"),
    ("raytrain_events.core.mixture_plan", "raytrain_events.core.mixture"),
    ("raytrain_events.core.mixture_online", "raytrain_events.core.mixture"),
}


def _modules(package: pathlib.Path) -> Dict[str, pathlib.Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


def _rel(package: pathlib.Path, path: pathlib.Path) -> str:
    return path.relative_to(package).as_posix()


def _docstring_nodes(tree: ast.AST) -> Set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _parents(tree: ast.AST) -> Dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def run_dir_literals(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: 'literal'`` for each run-directory name spelled outside `RunDir`'s module."""
    hits = []
    for path in _modules(package).values():
        if _rel(package, path) == RUN_DIR_OWNER:
            continue
        tree = _tree(path)
        docstrings, parents = _docstring_nodes(tree), _parents(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docstrings:
                continue
            parent = parents.get(id(node))
            is_key = (isinstance(parent, ast.Dict) and node in parent.keys) or (
                isinstance(parent, ast.Subscript) and parent.slice is node
            )
            value = node.value
            field_read = isinstance(parent, ast.Call) and ast.unparse(parent.func).endswith((".get", ".pop"))
            as_path_piece = isinstance(parent, (ast.JoinedStr, ast.BinOp, ast.Assign)) or (
                isinstance(parent, ast.Call) and node in parent.args and not field_read
            )
            in_path = any(
                f"/{d}/" in value or value.endswith(f"/{d}") or value.startswith(f"{d}/") for d in RUN_DIR_NAMES
            )
            if (value in RUN_FILE_NAMES and not is_key) or (value in RUN_DIR_NAMES and as_path_piece) or in_path:
                hits.append(f"{_rel(package, path)}:{node.lineno}: {value!r}")
    return sorted(hits)


def deletions(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: call`` for each storage deletion outside the modules allowed to delete."""
    hits = []
    for path in _modules(package).values():
        rel = _rel(package, path)
        if rel in DELETE_ALLOWED:
            continue
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            os_remove = isinstance(func, ast.Attribute) and name == "remove" and ast.unparse(func.value) == "os"
            if name in DELETE_CALLS or os_remove:
                hits.append(f"{rel}:{node.lineno}: {ast.unparse(func)}(...)")
    return hits


def _type_only_ids(tree: ast.AST) -> Set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def import_graph(package: pathlib.Path = PACKAGE) -> Dict[Tuple[str, str], bool]:
    """Every import edge (importer, imported) among the package's modules -> whether it is type-only."""
    modules = _modules(package)
    root = package.name

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    edges: Dict[Tuple[str, str], bool] = {}
    for module, path in modules.items():
        tree = _tree(path)
        type_only = _type_only_ids(tree)
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for target in targets:
                if target.split(".")[0] != root:
                    continue
                target = owner(target)
                if target and target != module:
                    key = (module, target)
                    edges[key] = edges.get(key, True) and id(node) in type_only
    return edges


def import_cycles(package: pathlib.Path = PACKAGE) -> List[List[str]]:
    """The groups of more than one module that import each other (mutually reachable), allowlisted edges removed."""
    graph: Dict[str, Set[str]] = {}
    for a, b in import_graph(package):
        if (a, b) not in CYCLE_ALLOWED:
            graph.setdefault(a, set()).add(b)

    def reachable(start: str) -> Set[str]:
        seen: Set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            v = todo.pop()
            if v not in seen:
                seen.add(v)
                todo.extend(graph.get(v, ()))
        return seen

    reach = {v: reachable(v) for v in graph}
    groups = {tuple(sorted({v} | {w for w in reach[v] if v in reach.get(w, ())})) for v in graph if v in reach[v]}
    return sorted(list(g) for g in groups)


def unmapped_files(package: pathlib.Path = PACKAGE) -> Iterator[str]:
    """``package: file`` for each module (or ``package: sub/`` for each subpackage) its package's docstring does
    not name."""
    for init in sorted(package.rglob("*.py")):
        if init.name != "__init__.py":
            continue
        doc = ast.get_docstring(_tree(init)) or ""
        for path in sorted(init.parent.glob("*.py")):
            if path.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(path.stem)}(?!\w)", doc):
                yield f"{_rel(package, init.parent) or package.name}: {path.name}"
        for sub in sorted(init.parent.glob("*/__init__.py")):
            if not re.search(rf"(?<![\w.]){re.escape(sub.parent.name)}(?!\w)", doc):
                yield f"{_rel(package, init.parent) or package.name}: {sub.parent.name}/"
    for folder in sorted(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if any(folder.glob("*.py")) and not (folder / "__init__.py").exists():
            yield f"{_rel(package, folder)}: no __init__.py (so no docstring to map its files)"


def test_only_run_dir_spells_run_directory_names():
    hits = run_dir_literals()
    assert not hits, (
        "Run-directory names spelled outside storage/run_dir.py (use RunDir's properties or its constants):\n"
        + "\n".join(hits)
    )


def test_only_the_checkpoint_folder_deletes_checkpoints():
    hits = deletions()
    assert not hits, (
        "Deletions outside checkpoint/folder/folder.py (a checkpoint is deleted by CheckpointFolder, through its "
        "retention) and the storage modules allowed to delete non-checkpoints:\n" + "\n".join(hits)
    )


def test_the_package_has_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, (
        "Import cycles among raytrain_events modules (move the shared name to a module both import):\n"
        + ("\n".join(" <-> ".join(c) for c in cycles))
    )


def test_allowlisted_cycle_edges_are_type_only_and_still_needed():
    edges = import_graph()
    for edge in CYCLE_ALLOWED:
        assert edges.get(edge) is True, f"{edge}: allowlisted as a type-only import, but it is {edges.get(edge)}"
        assert (edge[1], edge[0]) in edges, f"{edge}: no longer part of a cycle; drop it from CYCLE_ALLOWED"


def test_each_package_docstring_lists_its_files():
    missing = list(unmapped_files())
    assert not missing, "Files missing from their package's docstring (its map of files):\n" + "\n".join(missing)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """Each scan flags a planted offence (so a scan that matches nothing cannot pass for a clean package)."""
    pkg = tmp_path / "raytrain_events"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Files: sub."""\n')
    (pkg / "sub" / "__init__.py").write_text('"""Files: a."""\n')
    (pkg / "sub" / "a.py").write_text(
        "from raytrain_events.sub.b import y\n"
        "x = 1\n"
        "def f(fs, run):\n"
        "    fs.rm(run + '/checkpoints/ckpt-1', recursive=True)\n"
        "    return join(run, 'summary.json'), {'checkpoints': []}, run.get('checkpoints')\n"
        "HANGS = 'hangs'\n"
    )
    (pkg / "sub" / "b.py").write_text("y = 2\ndef g():\n    from raytrain_events.sub.a import x\n    return x\n")
    (pkg / "sub" / "inner").mkdir()
    (pkg / "sub" / "inner" / "__init__.py").write_text('"""Nothing."""\n')
    assert sorted(h.split(":", 1)[1] for h in run_dir_literals(pkg)) == [
        "4: '/checkpoints/ckpt-1'",
        "5: 'summary.json'",
        "6: 'hangs'",
    ]
    assert deletions(pkg) == ["sub/a.py:4: fs.rm(...)"]
    assert import_cycles(pkg) == [["raytrain_events.sub.a", "raytrain_events.sub.b"]]
    assert list(unmapped_files(pkg)) == ["sub: b.py", "sub: inner/"]


#: The modules that must not branch on how the run survives a failure: they ask the strategy
#: (``ray/fault_tolerance/``) for its parts instead.
FAULT_TOLERANCE_NEUTRAL = ("ray/driver.py", "ray/worker.py")


def fault_tolerance_branches(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: text`` for each place in `FAULT_TOLERANCE_NEUTRAL` that reads ``fault_tolerance`` off the spec,
    names a mode (``"replica_groups"``) or a replica module, or tests a ``replicas`` flag."""
    hits = []
    for rel in FAULT_TOLERANCE_NEUTRAL:
        path = package / rel
        if not path.exists():
            continue
        tree = _tree(path)
        docstrings = _docstring_nodes(tree)
        for node in ast.walk(tree):
            text = ""
            if isinstance(node, ast.Attribute) and node.attr == "fault_tolerance":
                text = "." + node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if "replica" in node.value:
                    text = repr(node.value)
            elif isinstance(node, ast.ImportFrom) and "replica" in (node.module or ""):
                text = f"import from {node.module}"
            elif isinstance(node, ast.Name) and "replica" in node.id.lower():
                text = node.id
            if text:
                hits.append(f"{rel}:{node.lineno}: {text}")
    return hits


def test_driver_and_worker_do_not_branch_on_fault_tolerance():
    hits = fault_tolerance_branches()
    assert not hits, (
        "ray/driver.py and ray/worker.py ask the run's fault-tolerance strategy (ray/fault_tolerance/) for its parts; "
        "they do not branch on the mode:\n" + "\n".join(hits)
    )


def test_the_fault_tolerance_scan_catches_a_branch(tmp_path):
    pkg = tmp_path / "raytrain_events"
    (pkg / "ray").mkdir(parents=True)
    (pkg / "ray" / "driver.py").write_text(
        '"""The driver: replica groups are not named here."""\n'
        "replicas = spec.fault_tolerance == 'replica_groups'\n"
        "if replicas:\n"
        "    from raytrain_events.ray.replica_groups import setup\n"
    )
    (pkg / "ray" / "worker.py").write_text("x = 1\n")
    assert sorted(h.split(": ", 1)[1] for h in fault_tolerance_branches(pkg)) == [
        "'replica_groups'",
        ".fault_tolerance",
        "import from raytrain_events.ray.replica_groups",
        "replicas",
        "replicas",
    ]


#: The run plan's decisions (``ray/plan.py``, `RunPlan`: made once on the driver, shipped to the workers) and
#: the `RunSpec` options they are made from. Reading such an option off the spec works the decision out again.
PLAN_OPTIONS = {"global_batch_size": "the global batch", "shuffle_buffer_size": "the train order"}
#: Where which of those options may be read: their definition and value checks, the owner, and refusals that
#: only check a combination (no decision is made from the value there).
PLAN_OPTION_READERS = {
    "ray/spec.py": (set(PLAN_OPTIONS), "defines the options"),
    "ray/spec_checks.py": (set(PLAN_OPTIONS), "checks their values"),
    "ray/plan.py": (set(PLAN_OPTIONS), "RunPlan: the owner of the decisions"),
    "ray/driver_checks.py": ({"shuffle_buffer_size"}, "refuses a row shuffle with a mixture, before Ray starts"),
    "data/ray/mixture_source.py": ({"shuffle_buffer_size"}, "refuses a row shuffle with a mixture (check_mixture)"),
}
#: The plan's typed values (``data/order.py``): built only by their owners; everyone else is handed one.
PLAN_VALUES = {"GlobalBatch", "TrainOrder"}
PLAN_VALUE_BUILDERS = {"ray/plan.py", "data/order.py"}
#: Where a batch size may be multiplied (the global batch's formula, `GlobalBatch.rows`).
BATCH_PRODUCTS = {
    "data/order.py": "GlobalBatch.rows: the formula",
    "data/mixture_loader.py": "the local Trainer's MixtureLoader: its own batch_size per rank, no RunSpec",
}


def plan_recomputations(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: text`` for each place that works a run-plan decision out again: it reads one of
    `PLAN_OPTIONS` off an object other than ``self``, builds a `PLAN_VALUES` value, or multiplies a batch size
    (``batch_size * workers``), outside their owners. Error messages (f-strings) do not count."""
    hits = []
    for path in _modules(package).values():
        rel = _rel(package, path)
        tree = _tree(path)
        in_fstring = {id(n) for f in ast.walk(tree) if isinstance(f, ast.JoinedStr) for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in in_fstring:
                continue
            text = ""
            if (
                isinstance(node, ast.Attribute)
                and node.attr in PLAN_OPTIONS
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
                and node.attr not in PLAN_OPTION_READERS.get(rel, (set(), ""))[0]
            ):
                text = f".{node.attr} ({PLAN_OPTIONS[node.attr]})"
            elif isinstance(node, ast.Call) and rel not in PLAN_VALUE_BUILDERS:
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in PLAN_VALUES and (node.args or node.keywords):  # ``TrainOrder()``: the dataset's own order
                    text = f"{name}(...)"
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and rel not in BATCH_PRODUCTS:
                names = [getattr(s, "attr", None) or getattr(s, "id", None) for s in (node.left, node.right)]
                if "batch_size" in names:
                    text = "batch_size * ... (the global batch)"
            if text:
                hits.append(f"{rel}:{node.lineno}: {text}")
    return hits


def test_the_run_plan_owns_the_global_batch_and_the_train_order():
    hits = plan_recomputations()
    assert not hits, (
        "The global batch and the train order are decided once, in ray/plan.py (RunPlan), and handed on "
        "(TrainDataConfig, the shards, the mixture run); read the plan instead of the options:\n" + "\n".join(hits)
    )


def test_the_plan_scan_catches_a_second_computation(tmp_path):
    pkg = tmp_path / "raytrain_events"
    (pkg / "ray" / "data").mkdir(parents=True)
    (pkg / "ray" / "plan.py").write_text("def of(spec):\n    return spec.global_batch_size, spec.shuffle_buffer_size\n")
    (pkg / "ray" / "data" / "order.py").write_text("class GlobalBatch:\n    pass\n")
    (pkg / "ray" / "data" / "loader.py").write_text(
        "def batch(spec, world):\n"
        "    return spec.global_batch_size or spec.batch_size * world\n"
        "def order(spec):\n"
        "    return TrainOrder(spec.seed if spec.shuffle_buffer_size else None)\n"
        "def message(spec):\n"
        "    return f'e.g. {2 * spec.batch_size}'\n"
        "class Loader:\n"
        "    def __init__(self, shuffle_buffer_size):\n"
        "        self.shuffle_buffer_size = shuffle_buffer_size\n"
    )
    assert sorted(h.split(": ", 1)[1] for h in plan_recomputations(pkg)) == [
        ".global_batch_size (the global batch)",
        ".shuffle_buffer_size (the train order)",
        "TrainOrder(...)",
        "batch_size * ... (the global batch)",
    ]


#: What the data package (``data/``) may import of the package besides itself: the pure logic, Ray's private names
#: (their one table), the tensor-parallel world check (the train shards' split) and the storage primitives
#: (seekable sources read through fsspec). Never the driver, worker, loop, callbacks or checkpoints.
DATA_IMPORTS = ("core", "data", "ray._compat", "parallel.world", "storage.fs")


def data_imports_outside(package: pathlib.Path = PACKAGE) -> List[str]:
    """``importer -> imported`` for each import from ``data/`` of a module outside `DATA_IMPORTS`."""
    root = package.name
    allowed = tuple(f"{root}.{name}" for name in DATA_IMPORTS)
    return sorted(
        f"{a} -> {b}"
        for a, b in import_graph(package)
        if a.startswith(f"{root}.data") and not (b in allowed or b.startswith(tuple(p + "." for p in allowed)))
    )


def test_the_data_package_imports_only_down_and_has_no_cycle():
    outside = data_imports_outside()
    assert not outside, "data/ imports only core/, itself and the few primitives in DATA_IMPORTS:\n" + "\n".join(
        outside
    )
    assert not [g for g in import_cycles() if any(m.startswith(f"{PACKAGE.name}.data") for m in g)]
    assert not [e for e in CYCLE_ALLOWED if any(m.startswith(f"{PACKAGE.name}.data") for m in e)]


def test_the_data_import_scan_catches_a_climb(tmp_path):
    pkg = tmp_path / "raytrain_events"
    for sub in ("data", "core", "ray", "trainer"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text('"""x"""\n')
    (pkg / "core" / "mixture.py").write_text("x = 1\n")
    (pkg / "trainer" / "trainer.py").write_text("x = 1\n")
    (pkg / "ray" / "_compat.py").write_text("x = 1\n")
    (pkg / "data" / "loader.py").write_text(
        "from raytrain_events.core.mixture import x\n"
        "from raytrain_events.ray import _compat\n"
        "def f():\n"
        "    from raytrain_events.trainer.trainer import x\n"
    )
    assert data_imports_outside(pkg) == ["raytrain_events.data.loader -> raytrain_events.trainer.trainer"]


def test_the_autoresume_without_a_name_refusal_has_one_owner():
    """`Trainer` and `RayTrainer` refuse ``autoresume`` in a run without a name through one function
    (``trainer/arguments.check_autoresume_named``); the message is spelled nowhere else."""
    spelled = []
    for path in _modules(PACKAGE).values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "without a run_name" in node.value:
                spelled.append(_rel(PACKAGE, path))
    assert spelled == ["trainer/arguments.py"], spelled


#: Which checkpoints are validated (`validates`: every ``every``-th one a worker group reports) is decided where the
#: validation is asked for, once per path, and recorded in the checkpoint's entry (``ASKED_KEY``); everyone else reads
#: the mark (`unfinished_validations`), never counts again.
VALIDATION_CHOOSERS = {
    "ray/reports/worker_reports.py": "rank 0's RayReporter asks Ray Train to validate (plain and restarting runs)",
    "ray/reports/history.py": "RunHistory starts the replica groups' validations (Ray Train never sees them)",
}


def validation_recounts(package: pathlib.Path = PACKAGE) -> List[str]:
    """``file:line: text`` for each place outside `VALIDATION_CHOOSERS` that decides again which checkpoints are
    validated: it calls ``validates(...)``, or reads ``.every`` off an object other than ``self`` (the option's
    own checks in ``ray/async_validation.py`` and the rule, `validates`, in ``ray/checkpointing/validation.py``)."""
    rule = {"ray/async_validation.py", "ray/checkpointing/validation.py"}
    hits = []
    for path in _modules(package).values():
        rel = _rel(package, path)
        if rel in VALIDATION_CHOOSERS:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in {
                "validates"
            }:
                hits.append(f"{rel}:{node.lineno}: validates(...)")
            elif (
                rel not in rule
                and isinstance(node, ast.Attribute)
                and node.attr == "every"
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                hits.append(f"{rel}:{node.lineno}: .every")
    return sorted(hits)


def test_the_validated_checkpoints_are_chosen_in_one_place_per_path():
    hits = validation_recounts()
    assert not hits, (
        "Which checkpoints are validated is decided where the validation is asked for (VALIDATION_CHOOSERS), which "
        "marks the entry (ASKED_KEY); read the mark instead of counting checkpoints again:\n" + "\n".join(hits)
    )


def test_the_validation_scan_catches_a_second_count(tmp_path):
    pkg = tmp_path / "raytrain_events"
    (pkg / "ray" / "reports").mkdir(parents=True)
    (pkg / "ray" / "reports" / "history.py").write_text("def add(v, n):\n    return validates(v, n)\n")
    (pkg / "ray" / "driver.py").write_text(
        "def unfinished(entries, validation):\n"
        "    counts = 0\n"
        "    for e in entries:\n"
        "        counts += 1\n"
        "        if validates(validation, counts) or counts % validation.every == 0:\n"
        "            yield e\n"
        "class Option:\n"
        "    def check(self):\n"
        "        return self.every > 0\n"
    )
    assert [h.split(": ", 1)[1] for h in validation_recounts(pkg)] == [".every", "validates(...)"]
