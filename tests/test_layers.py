"""rrpc's shape holds: layers import downward only, no import circle, no
library file over 600 lines, and ARCHITECTURE.md's layer table is the contract.

The layers are the import-linter contract in pyproject.toml
(``[tool.importlinter]``, top to bottom; ``make lint`` runs ``lint-imports``
on it). CI runs only ``make test``, so this file checks the same rules from
the source itself, without import-linter: every ``import`` statement of every
module counts, those inside functions and under ``TYPE_CHECKING`` included
(an import inside a function is still a dependency, only a later one).
Modules of one layer may import each other; a module in no layer fails, so
that a new module is placed (here and in ARCHITECTURE.md) when it is made.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rrpc"
MAX_LINES = 600  # a library file longer than this holds more than one job


def _layers() -> list[set[str]]:
    """The contract's layers, top first: each a set of module names under rrpc."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert contract["containers"] == ["rrpc"]
    layers = []
    for line in contract["layers"]:
        assert "|" not in line, f"layer {line!r}: only ':' siblings are checked here"
        layers.append({tail.strip() for tail in line.split(":")})
    return layers


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of ``package``: dotted name -> file."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, int]:
    """The modules of ``known`` that module ``name`` imports, anywhere in its
    file (functions and ``TYPE_CHECKING`` blocks included): module -> first line."""
    found: dict[str, int] = {}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def add(target: str, line: int) -> None:
        while target and target not in known:  # rrpc.x.Name -> rrpc.x
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in known else base, node.lineno)
    return found


def import_graph(package: pathlib.Path) -> dict[str, dict[str, int]]:
    known = modules(package)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of
    more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def upward_imports(
    graph: dict[str, dict[str, int]], layers: list[set[str]], files: dict[str, pathlib.Path]
) -> tuple[list[str], list[str]]:
    """(imports that go up a layer, modules in no layer), each as a readable line.
    The package itself (its ``__init__``) is above every layer: it may import
    anything, and nothing may import it."""
    top = next(iter(graph)).split(".")[0]
    level = {}
    for depth, layer in enumerate(layers):
        for tail in layer:
            level[f"{top}.{tail}"] = depth

    def level_of(module: str) -> int | None:
        if module == top:
            return -1
        parts = module.split(".")
        return level.get(".".join(parts[:2]))

    unplaced = sorted(m for m in graph if level_of(m) is None)
    upward = []
    for importer, imported in sorted(graph.items()):
        for target, line in sorted(imported.items()):
            low, high = level_of(importer), level_of(target)
            if low is None or high is None or high >= low:
                continue
            where = files[importer].relative_to(files[top].parent.parent)
            upward.append(
                f"{where}:{line}: {importer} (layer {low + 1}) imports {target} (layer {high + 1})"
            )
    return upward, [f"{m} ({files[m]})" for m in unplaced]


# -- The checker, on a package made up here --------------------------------------
def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_sees_an_upward_import_inside_a_function(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "from pkg import top\n",
            "top.py": "from pkg import bottom\n",
            "bottom.py": "def later():\n    from pkg.top import thing\n",
        },
    )
    graph = import_graph(root)
    upward, unplaced = upward_imports(graph, [{"top"}, {"bottom"}], modules(root))
    assert upward == ["pkg/bottom.py:2: pkg.bottom (layer 2) imports pkg.top (layer 1)"]
    assert unplaced == []


def test_checker_sees_a_circle_and_an_unplaced_module(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from . import b\n",
            "b.py": "import pkg.c\n",
            "c.py": "if False:\n    import pkg.a\n",
            "new.py": "",
        },
    )
    graph = import_graph(root)
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    _, unplaced = upward_imports(graph, [{"a", "b", "c"}], modules(root))
    assert unplaced == [f"pkg.new ({root / 'new.py'})"]


# -- rrpc itself ---------------------------------------------------------------------
def test_every_import_goes_down_a_layer_or_stays_in_its_own():
    files = modules(PACKAGE)
    upward, unplaced = upward_imports(import_graph(PACKAGE), _layers(), files)
    assert not unplaced, (
        "modules in no layer: place each in [tool.importlinter] (pyproject.toml) "
        "and in ARCHITECTURE.md's layer table:\n" + "\n".join(unplaced)
    )
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_import_circle_among_rrpc_modules():
    found = circles(import_graph(PACKAGE))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_library_file_is_over_600_lines():
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_proto" not in path.parts  # generated (make proto)
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"library files over {MAX_LINES} lines: {too_long}"


def test_architecture_layer_table_is_the_contract():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    drawn = []
    for row in rows:
        files = row.split("|")[2]
        tails = set(re.findall(r"`rrpc/([A-Za-z_]+)(?:\.py|/)`", files)) - {"__init__"}
        drawn.append(tails)
    assert drawn == _layers()


def test_every_module_docstring_opens_with_one_line_saying_its_job():
    bad = []
    for path in modules(PACKAGE).values():
        if "_proto" in path.parts:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        first = doc.split("\n\n", 1)[0]
        if not first or "\n" in first:
            bad.append(f"{path.relative_to(ROOT)}: {first[:80]!r}")
    assert not bad, "module docstrings whose first paragraph is not one line:\n" + "\n".join(bad)
