"""No module of the project imports itself back through others: every import statement counts,
those inside functions too (an import put off to call time still ties the two files together),
but not those under `if TYPE_CHECKING:`, which never run. Importing `a.b.c` runs the packages
`a` and `a.b` first; those implied imports are not counted, only what the code names."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "ui", "storage", "kernels")
SCRIPTS = ("app.py",)


def module_files(root: Path, packages=PACKAGES, scripts=SCRIPTS) -> dict[str, Path]:
    """Module name -> file, for every module of `packages` and the top-level `scripts`."""
    files = [path for package in packages for path in sorted((root / package).rglob("*.py"))]
    files += [root / script for script in scripts if (root / script).exists()]
    modules = {}
    for path in files:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under an `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that the module `name` imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)

    def known(dotted: str) -> str | None:  # `a.b.thing`: the module `a.b` when `thing` is not one
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            found.update(known(f"{base}.{alias.name}" if base else alias.name) for alias in node.names)
    found.discard(None)
    found.discard(name)
    return found


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Every set of modules that import each other (strongly connected, more than one), each
    as one cycle through all of its members where there is one, else its members."""
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's, iteratively: deep import chains exceed recursion limits
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [_a_cycle(group, graph) for group in groups]


def _a_cycle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A path from the group's first module back to it through the group: what a reader follows."""
    members = set(group)
    start = group[0]
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for target in sorted(graph[path[-1]] & members):
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                paths.append(path + [target])
    return group


def test_the_project_has_no_import_cycle():
    cycles = import_cycles(module_files(ROOT))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_a_cycle_through_a_function_level_import_is_found_and_named(tmp_path):
    """The check itself: a cycle closed inside a function is found and named in order; a pair that
    import each other only for type checking, and a package importing its own module, are not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.alpha import run\n")
    (package / "alpha.py").write_text("from pkg import beta\n\ndef run():\n    return beta.go()\n")
    (package / "beta.py").write_text("def go():\n    from pkg.gamma import helper\n    return helper()\n")
    (package / "gamma.py").write_text("from . import alpha\n\ndef helper():\n    return alpha\n")
    (package / "typed_a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from pkg.typed_b import B\n")
    (package / "typed_b.py").write_text("from pkg.typed_a import *\n")
    modules = module_files(tmp_path, packages=("pkg",), scripts=())
    assert import_cycles(modules) == [["pkg.alpha", "pkg.beta", "pkg.gamma", "pkg.alpha"]]
    (package / "gamma.py").write_text("def helper():\n    return 1\n")
    assert import_cycles(modules) == []
