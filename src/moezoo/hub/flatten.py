"""Copy model code into one flat folder that `trust_remote_code` can load.

transformers' remote code only follows `from .<module> import <names>` between files of one folder
(platform.md §1.2): no sub-packages, no parent imports, no absolute imports of a package the user does not have.
`flatten_modules` takes the entry modules of an architecture (configuration, modeling, processing), follows every
import of project code they make, transitively, and writes each module once as `<flat name>.py` with those
imports rewritten to the flat form.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path


# Role folders whose flat names follow transformers' file naming (processing_x.py, not processors_x.py).
FLAT_ROLE_NAMES = {"processors": "processing"}


class FlattenError(ValueError):
    pass


@dataclass
class _Module:
    name: str
    path: Path
    source: str
    # (first line, last line, column, target module, "a, b as c") of each import to rewrite
    imports: list[tuple[int, int, int, str, str]] = field(default_factory=list)


def flat_name(module_name: str) -> str:
    """`moezoo.modeling.moe.block` -> `modeling_moe_block`, `moezoo.processors.moe_vie` -> `processing_moe_vie`."""
    parts = module_name.split(".")[1:] or module_name.split(".")
    parts[0] = FLAT_ROLE_NAMES.get(parts[0], parts[0])
    return "_".join(parts)


def flatten_modules(entry_modules: list[str], out_dir: Path, project_packages: set[str] | None = None) -> dict[str, str]:
    """Write the entry modules and the project modules they import into `out_dir`.

    `project_packages` are the top-level packages whose modules are copied (default: those of the entry modules);
    imports of anything else (torch, transformers, ...) are left alone. Returns {module name: flat file stem}.
    """
    project_packages = project_packages or {name.split(".")[0] for name in entry_modules}
    modules: dict[str, _Module] = {}
    pending = list(entry_modules)
    while pending:
        name = pending.pop()
        if name in modules:
            continue
        module = _read_module(name)
        modules[name] = module
        for node in ast.walk(ast.parse(module.source, filename=str(module.path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in project_packages:
                        raise FlattenError(
                            f"{name} (line {node.lineno}): `import {alias.name}` cannot be flattened; write "
                            f"`from <module> import <names>` instead"
                        )
            elif isinstance(node, ast.ImportFrom):
                target = _import_target(module, node)
                if target is None or target.split(".")[0] not in project_packages:
                    continue
                _check_imports_names_not_modules(name, node, target)
                aliases = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
                module.imports.append((node.lineno, node.end_lineno, node.col_offset, target, aliases))
                pending.append(target)

    names = {}
    for name in modules:
        stem = flat_name(name)
        if stem in names.values():
            raise FlattenError(f"two modules flatten to {stem}.py; rename one of them ({name})")
        names[name] = stem
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, module in modules.items():
        lines = module.source.splitlines(keepends=True)
        for first, last, column, target, aliases in sorted(module.imports, reverse=True):
            indent = lines[first - 1][:column]
            lines[first - 1 : last] = [f"{indent}from .{names[target]} import {aliases}\n"]
        (out_dir / f"{names[name]}.py").write_text("".join(lines))
    return names


def _read_module(name: str) -> _Module:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise FlattenError(f"cannot find the source file of module {name}")
    path = Path(spec.origin)
    if path.name == "__init__.py":
        raise FlattenError(
            f"{name} is a package: model code must import names from the module that defines them "
            f"(e.g. `from .moe.block import SparseMoeBlock`), not from a package's __init__"
        )
    return _Module(name, path, path.read_text())


def _import_target(module: _Module, node: ast.ImportFrom) -> str | None:
    """The absolute module an ImportFrom reads from."""
    if node.level == 0:
        return node.module
    package = module.name.split(".")[:-1]
    if node.level - 1 > len(package):
        raise FlattenError(f"{module.name} (line {node.lineno}): relative import beyond the top-level package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _check_imports_names_not_modules(name: str, node: ast.ImportFrom, target: str) -> None:
    for alias in node.names:
        if _is_submodule(f"{target}.{alias.name}"):
            raise FlattenError(
                f"{name} (line {node.lineno}): `from {'.' * node.level}{node.module or ''} import {alias.name}` "
                f"imports a module object, which remote code cannot load; import the names you need from it"
            )


def _is_submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
