"""Import direction and cycles, checked by parsing every module under ``src/lmrl`` (no importing).

``TABLE`` lists lmrl's packages top to bottom and fixes the direction: a package may import
the packages above it, never one below. Three rows may import nothing of lmrl though they sit
above others: ``algos/`` (pure tensor maths), ``tools/`` and ``logging/``. The leaves
``lmrl.errors``, ``lmrl._lazy``, ``lmrl._userfile``, ``lmrl._procpool`` and ``lmrl._procworker``
import nothing of lmrl, and every
package may import them.

Every import counts: at module level, inside functions (a lazy import is still a dependency),
relative ones (``from . import x``), and a module path passed as a string to a call
(``importlib.import_module("lmrl.algos.kl")`` or a wrapper of it; logger names do not count).
Cycles are checked twice: among module-level imports (the ones that run when a module is
imported), and counting function-level ones too (a lazy import that closes a loop hides a
cycle rather than removing it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lmrl"

# The package table of ../shared/DESIGN.md, top to bottom: package -> the lmrl packages it may
# import, either ``ABOVE`` (every package above it) or an explicit tuple (only these). ``batch``
# is the package batch/ (the Batch and its key schema), ``cli`` the package cli/ (the parser
# and main; commands.py). Where the code imports more than DESIGN.md's column names, the extra
# packages are listed apart (``# beyond DESIGN.md``) with the reason: they are the honest
# imports of today's code, each a candidate for the design or for a change.
ABOVE = "everything above"
TABLE: tuple[tuple[str, tuple[str, ...] | str], ...] = (
    ("algos", ()),
    ("batch", ()),
    # beyond DESIGN.md: algos (registry-valued keys are checked against the registries at load)
    ("config", ("algos",)),
    # beyond DESIGN.md: batch (data/dataset.py builds the prompt Batch it hands the rollout)
    ("data", ("batch",)),
    # beyond DESIGN.md: algos (the DAPO overlong penalty and masked means in the managers)
    ("rewards", ("data", "batch", "algos")),
    # beyond DESIGN.md: algos (log-probs and entropy from logits), batch (the forward's input)
    ("models", ("algos", "batch")),
    ("tools", ()),
    # beyond DESIGN.md: algos (the rollout's own log-probs through algos.logprob)
    ("rollout", ("models", "tools", "batch", "algos")),
    ("serve", ("rollout", "models", "batch", "config")),
    # beyond DESIGN.md: batch (the trajectory Batch), data (the shapes task's prompt attributes)
    ("flow", ("algos", "models", "batch", "data")),
    # beyond DESIGN.md: config (each worker takes its config section)
    ("workers", ("models", "rollout", "rewards", "algos", "batch", "config")),
    ("logging", ()),
    # the loop and its state: it runs any program and imports none (no trainer, flow, demos)
    # beyond DESIGN.md: models (a checkpoint refuses weights of another shape on load)
    ("run", ("config", "logging", "batch", "models")),
    ("trainer", ABOVE),
    ("sweep", ABOVE),
    ("demos", ABOVE),
    ("cli", ABOVE),
)
# Leaves that import nothing of lmrl; any module may import them ("" is ``lmrl/__init__.py``).
LEAVES = frozenset({"errors", "_lazy", "_userfile", "_procpool", "_procworker", ""})


def allowed_packages(table: Iterable[tuple[str, tuple[str, ...] | str]]) -> dict[str, frozenset]:
    """Package -> the packages it may import: its column, itself, and the leaves.

    A name in a column that is not above its row is an error in the table itself.
    """
    allowed: dict[str, frozenset] = {}
    above: list[str] = []
    for package, column in table:
        names = tuple(above) if column == ABOVE else tuple(column)
        below = [name for name in names if name not in above]
        if below:
            raise ValueError(f"table: {package} may import {below}, which are not above it")
        allowed[package] = frozenset(names) | {package} | LEAVES
        above.append(package)
    return allowed


ALLOWED = allowed_packages(TABLE)


# ------------------------------------------------------------------------------ the parser
@dataclass(frozen=True)
class Import:
    """One import of an lmrl module: the importing module, the imported one, where."""

    module: str  # "lmrl.logging.console"
    imported: str  # "lmrl.logging.trackers"
    line: int
    top_level: bool  # runs when ``module`` is imported: not in a function, not under TYPE_CHECKING


def module_name(path: Path, root: Path = SRC) -> str:
    """``src/lmrl/logging/trackers.py`` -> ``lmrl.logging.trackers`` (a package: its name)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The row of the table a module belongs to: ``lmrl.logging.trackers`` -> ``logging``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` starts with (None when it is not lmrl's)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import of a known lmrl module in ``source`` (the text of ``module``).

    Args:
        source: the module's Python text.
        module: its dotted name (``lmrl.logging``, ``lmrl.logging.trackers``).
        is_package: whether it is a package's ``__init__.py`` (relative imports start there).
        known: the dotted names of every lmrl module and package.

    Returns:
        One :class:`Import` per imported lmrl module per import statement (or call).
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def add(name: str | None, node: ast.AST, top_level: bool) -> None:
        target = _resolve(name, known) if name else None
        if target is not None and target != module:
            found.append(Import(module, target, node.lineno, top_level))

    def visit(node: ast.AST, top_level: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, top_level)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                # ``from lmrl.logging import console`` imports the submodule when there is one
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node, top_level)
        elif isinstance(node, ast.Call) and _call_name(node.func) != "getLogger":
            for arg in node.args:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value in known
                ):
                    add(arg.value, node, top_level)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top_level = False
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                visit(child, False)
            else:
                visit(child, top_level)

    visit(tree, True)
    return found


# ------------------------------------------------------------------------------- the checks
def violations(imports: Iterable[Import], allowed: Mapping[str, frozenset] = ALLOWED) -> list[str]:
    """``module -> imported`` for every import the table does not allow, sorted.

    A module outside the table's packages (a new package nobody placed) is a violation too.
    """
    out = set()
    for imp in imports:
        package = package_of(imp.module)
        if package in LEAVES:
            ok = package_of(imp.imported) == package
        elif package not in allowed:
            why = f"package {package!r} is not in the table"
            out.add((imp.module, imp.imported, 0, f"{imp.module} -> {imp.imported} ({why})"))
            continue
        else:
            ok = package_of(imp.imported) in allowed[package]
        if not ok:
            line = f"{imp.module} -> {imp.imported} (line {imp.line})"
            out.add((imp.module, imp.imported, imp.line, line))
    return [line for *_, line in sorted(out)]


def cycles(imports: Iterable[Import]) -> list[list[str]]:
    """The import cycles among modules (strongly connected components of two or more, or a
    module importing itself), each as a sorted list of module names."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.module, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    # Tarjan's algorithm, iterative (no recursion limit on a deep chain).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def _tree() -> list[Import]:
    files = sorted(SRC.rglob("*.py"))
    known = {module_name(p) for p in files}
    out: list[Import] = []
    for path in files:
        out += imports_of(
            path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py", known
        )
    return out


TREE = _tree()


# ------------------------------------------------------------------------------ on the tree
def test_tree_is_parsed():
    assert TREE, "no lmrl imports found: is SRC right?"
    assert any(i.module == "lmrl.trainer.build" for i in TREE)


def test_the_loop_imports_no_program():
    """`lmrl.run` is its own room: no arrow from it into the programs or the tools of a run."""
    programs = {"trainer", "flow", "sweep", "demos", "cli", "rollout", "workers", "rewards"}
    found = [
        f"{i.module} -> {i.imported}"
        for i in TREE
        if package_of(i.module) == "run" and package_of(i.imported) in programs
    ]
    assert not found, found
    assert any(package_of(i.module) == "run" for i in TREE)


def test_imports_point_down_the_package_table():
    found = violations(TREE)
    assert not found, "imports the package table does not allow:\n" + "\n".join(found)


def test_no_import_cycles_between_modules():
    found = cycles(i for i in TREE if i.top_level)
    assert not found, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_counting_lazy_imports():
    found = cycles(TREE)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_package_is_in_the_table():
    packages = {p.name.removesuffix(".py") for p in SRC.iterdir() if not p.name.startswith(".")}
    packages -= {"__pycache__", "__init__"}
    assert packages <= set(ALLOWED) | LEAVES, packages - set(ALLOWED) - LEAVES


# ------------------------------------------------------------------------ the checker itself
KNOWN = {
    "lmrl",
    "lmrl.errors",
    "lmrl._lazy",
    "lmrl.batch",
    "lmrl.algos",
    "lmrl.algos.kl",
    "lmrl.algos.registry",
    "lmrl.models",
    "lmrl.models.forward",
    "lmrl.logging",
    "lmrl.logging.console",
    "lmrl.logging.trackers",
    "lmrl.trainer",
    "lmrl.trainer.build",
}


def _imports(source: str, module: str, is_package: bool = False) -> list[Import]:
    return imports_of(source, module, is_package, KNOWN)


def test_checker_resolves_every_import_form():
    source = (
        "import os\n"
        "import lmrl.algos.kl\n"
        "from lmrl.batch import Batch\n"
        "from lmrl import errors\n"
        "from . import trackers\n"
        "from .console import ConsoleTracker\n"
        "from .. import models\n"
        "def f():\n"
        "    from lmrl.algos.registry import Registry\n"
        "    return importlib.import_module('lmrl.models.forward')\n"
        "log = logging.getLogger('lmrl.trainer')\n"
    )
    found = _imports(source, "lmrl.logging", is_package=True)
    assert [(i.imported, i.top_level) for i in found] == [
        ("lmrl.algos.kl", True),
        ("lmrl.batch", True),
        ("lmrl.errors", True),
        ("lmrl.logging.trackers", True),
        ("lmrl.logging.console", True),
        ("lmrl.models", True),
        ("lmrl.algos.registry", False),
        ("lmrl.models.forward", False),
    ]


def test_checker_relative_import_from_a_module_starts_at_its_package():
    found = _imports("from .trackers import Tracker\n", "lmrl.logging.console")
    assert [i.imported for i in found] == ["lmrl.logging.trackers"]


def test_checker_type_checking_imports_are_not_module_level():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmrl.batch import B\n"
    assert [i.top_level for i in _imports(source, "lmrl.algos.kl")] == [False]


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # algos uses nothing of lmrl but the leaves
        ("lmrl.algos.kl", "from lmrl.batch import Batch\n", ["lmrl.algos.kl -> lmrl.batch"]),
        ("lmrl.algos.kl", "from lmrl._lazy import lazy_exports\nimport lmrl.errors\n", []),
        # an arrow up the table, even from inside a function
        (
            "lmrl.models.forward",
            "def f():\n    from lmrl.trainer.build import build_run\n",
            ["lmrl.models.forward -> lmrl.trainer.build"],
        ),
        # logging may import nothing of lmrl, though trainer sits below it
        (
            "lmrl.logging.console",
            "from lmrl.batch import Batch\n",
            ["lmrl.logging.console -> lmrl.batch"],
        ),
        ("lmrl.logging.console", "from lmrl.logging.trackers import Tracker\n", []),
        # the trainer may import everything above it
        ("lmrl.trainer.build", "from lmrl.logging import make_trackers\nimport lmrl.models\n", []),
        # a leaf that imports lmrl is no longer a leaf
        ("lmrl.errors", "from lmrl.batch import Batch\n", ["lmrl.errors -> lmrl.batch"]),
    ],
)
def test_checker_catches_a_violating_import(module, source, expected):
    found = [v.split(" (")[0] for v in violations(_imports(source, module))]
    assert found == expected


def test_checker_names_a_package_missing_from_the_table():
    found = violations(_imports("import lmrl.batch\n", "lmrl.newpkg.x"))
    assert found == ["lmrl.newpkg.x -> lmrl.batch (package 'newpkg' is not in the table)"]


def test_checker_finds_cycles():
    edges = [
        Import("lmrl.a", "lmrl.b", 1, True),
        Import("lmrl.b", "lmrl.c", 1, True),
        Import("lmrl.c", "lmrl.a", 1, True),
        Import("lmrl.c", "lmrl.d", 1, True),
        Import("lmrl.e", "lmrl.e", 1, True),
    ]
    assert cycles(edges) == [["lmrl.a", "lmrl.b", "lmrl.c"], ["lmrl.e"]]
    assert cycles(edges[:2]) == []


def test_table_refuses_a_column_naming_a_row_below():
    with pytest.raises(ValueError, match="not above it"):
        allowed_packages([("algos", ("trainer",)), ("trainer", ())])
