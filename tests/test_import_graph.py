"""moezoo's modules import one another in one direction: no circle of imports among them (issue 28, item 3).

Every module of the package is parsed (nothing is imported), and every import it makes counts, wherever it stands: at
the top, inside a function (a deferred import hides a circle from Python, not from the design), under
`TYPE_CHECKING`; relative or absolute; `from package import module` as an arrow to that module, `from package import
name` as one to the package's `__init__.py`. That importing a submodule first runs its package's `__init__.py` (which
often imports the submodule back) is Python's own arrow and is not counted.

On the source of commit c10780e, before issue 28's item 3, it failed naming the four circles that item names (checked
once): `bench.moemb` <-> `bench.moemb_adaptive`, `kernels.sorted_experts` <-> `kernels.triton_experts`,
`modeling.moemb` <-> `modeling.moemb_adaptive.gates`, `training.moemb` <-> `training.moemb_grpo`.
"""

import ast
import importlib.util
from pathlib import Path

PACKAGE = "moezoo"


def package_modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, whether it is a package's `__init__.py`)} of every module under `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement of `module` asks for, relative ones resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """{module: {module it imports: line of the first such import}}, among `modules` only."""
    graph = {}
    for module, (path, is_package) in modules.items():
        arrows = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in imported_names(node, module, is_package):
                while name and name not in modules:  # `from module import function` -> module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    arrows.setdefault(name, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle of each strongly connected group of modules (Tarjan's algorithm), as [a, b, ..., a]."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = set()
            while module not in group:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [shortest_circle(graph, group) for group in groups]


def shortest_circle(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, through the group (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    return paths[module] + [start]
                if target in group and target not in paths:
                    paths[target] = paths[module] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} holds no circle")


def describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_no_module_of_the_package_imports_itself_back():
    root = Path(importlib.util.find_spec(PACKAGE).origin).parent
    graph = import_graph(package_modules(root, PACKAGE))
    # Arrows into subpackages and between siblings are seen (a resolution gone wrong would leave them out).
    assert {"moezoo.modeling.moemb_adaptive.gates", "moezoo.modeling.moe.block"} <= set(graph["moezoo.modeling.moemb"])
    assert {"moezoo.registry", "moezoo"} <= graph["moezoo.zoo"].keys()
    found = circles(graph)
    assert found == [], "import circles among moezoo's modules:\n" + "\n".join(describe(graph, c) for c in found)


def test_a_circle_through_a_deferred_import_is_found(tmp_path):
    """The check itself: `b` imports `a` only inside a function, `c` joins through the package's `__init__`."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from .sub.b import g\n\ndef f():\n    return g()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    (package / "c.py").write_text("import pkg.sub.b\nfrom pkg import f\n")
    graph = import_graph(package_modules(package, "pkg"))
    assert graph["pkg.c"] == {"pkg.sub.b": 1, "pkg": 2}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    assert describe(graph, ["pkg.a", "pkg.sub.b", "pkg.a"]) == "pkg.a (line 1) -> pkg.sub.b (line 2) -> pkg.a"
