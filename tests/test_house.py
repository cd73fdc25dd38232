"""The house rules a machine can check (docs/ARCHITECTURE.md, ../shared/STYLE.md), read from the
sources (nothing is imported): imports point one way, cli -> runtime -> runtime/cuda, and the
modules' own top-level imports form no circle (imports inside functions, such as runtime.backend
choosing a backend, and under `if TYPE_CHECKING:` are the exceptions the rules name); the
runtime reads the environment in one place (runtime/flags.py: values are passed in, not read deep
inside); no source file is over MAX_LINES lines. No GPU."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the installed package's names of the source folders (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = {"cli": "k4.cli", "runtime": "k4.runtime", "kernels_cu": "k4.kernels_cu"}
MAX_LINES = 450  # one responsibility a file: past this, a file holds two
ENVIRONMENT_READERS = {"runtime/flags.py"}  # the runtime's one reader of os.environ (Flags)
SOURCE_FOLDERS = ("cli", "runtime", "kernels_cu", "scripts", "tests")


def module_files() -> dict[str, Path]:
    """k4 module name -> its source file, for every .py under the package folders."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str, path: Path, modules: dict[str, Path], top_level: bool) -> set[str]:
    """The k4 modules that module `name` imports: at the top of the module (top_level; not under
    `if TYPE_CHECKING:`), or anywhere in it. `from P import M` counts M where it is a module, else P."""
    tree = ast.parse(path.read_text())
    if top_level:
        nodes = [n for stmt in tree.body if not _type_checking(stmt)
                 for n in (ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt])]
    else:
        nodes = list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent) + (f".{base}" if base else "")
            for a in node.names:
                target = f"{base}.{a.name}"
                found.add(target if target in modules else base)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_a_circle_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b"}}) == ["b", "b"]


def test_imports_resolve_relative_names_and_skip_type_checking(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom . import b\nfrom .c import f\nfrom ..d import g\n"
                   "if TYPE_CHECKING:\n    from .e import T\n\ndef late():\n    from . import h\n")
    modules = {n: src for n in ("k4.runtime.cuda.mod", "k4.runtime.cuda.b", "k4.runtime.cuda.c", "k4.runtime.d",
                                "k4.runtime.cuda.e", "k4.runtime.cuda.h")}
    assert imports("k4.runtime.cuda.mod", src, modules, True) == {"k4.runtime.cuda.b", "k4.runtime.cuda.c", "k4.runtime.d"}
    assert imports("k4.runtime.cuda.mod", src, modules, False) == {"k4.runtime.cuda.b", "k4.runtime.cuda.c", "k4.runtime.d",
                                                                   "k4.runtime.cuda.e", "k4.runtime.cuda.h"}


def test_the_top_level_imports_form_no_circle():
    modules = module_files()
    assert "k4.runtime.cuda.forward" in modules and "k4.cli.app" in modules
    graph = {name: imports(name, path, modules, True) for name, path in modules.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_imports_point_from_the_cli_to_the_runtime_to_its_cuda_backend():
    modules = module_files()
    for name, path in modules.items():
        anywhere = imports(name, path, modules, False)
        top = imports(name, path, modules, True)
        if name.startswith("k4.runtime"):
            assert not any(m.startswith("k4.cli") for m in anywhere), f"{name} imports the CLI"
        if name.startswith("k4.runtime") and not name.startswith("k4.runtime.cuda"):
            assert not any(m.startswith("k4.runtime.cuda") for m in top), f"{name} imports the CUDA backend at load"
        if name.startswith("k4.kernels_cu"):
            assert not anywhere, f"{name} (CUDA sources) imports {sorted(anywhere)}"


def test_no_source_file_is_over_the_line_limit():
    files = [p for folder in SOURCE_FOLDERS for ext in ("*.py", "*.cu", "*.cuh") for p in (REPO / folder).rglob(ext)]
    assert len(files) > 100
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (move a responsibility into a file of its own): {long}"


def environment_reads(path: Path) -> list[int]:
    """Lines of `path` that read the process environment: os.environ, os.getenv, os.environb."""
    tree = ast.parse(path.read_text())
    return sorted(node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def test_environment_reads_are_found(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\na = os.environ.get('X')\nb = os.getenv('Y')\nc = {}.get('environ')\n")
    assert environment_reads(src) == [2, 3]


def test_the_runtime_reads_the_environment_only_in_flags():
    readers = {str(p.relative_to(REPO)) for p in (REPO / "runtime").rglob("*.py") if environment_reads(p)}
    assert readers == ENVIRONMENT_READERS, f"read the environment once, in runtime/flags.py, and pass values in: {sorted(readers)}"
