"""The packages' layering, read from the source (ast; no import runs): edge on top, decode_gpu and prefill_cpu side by
side, sampling under them, contracts and policies at the bottom (docs/architecture.md, "Components"). Every import
counts, those inside functions too: a lazy import still loads its module when the function runs."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("contracts", "policies", "sampling", "edge", "prefill_cpu", "decode_gpu", "bench", "checks")
# package -> the packages of ours it may import (itself always)
ALLOWED = {
    "contracts": (),
    "policies": (),
    "sampling": ("contracts",),  # one sampling semantics for both processes
    "decode_gpu": ("contracts", "sampling"),
    "prefill_cpu": ("contracts", "sampling"),
}
TORCH_FREE = "decode_gpu.core"  # the scheduler and its bookkeeping: the model runner is the only device owner


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(package: str) -> dict[str, Path]:
    return {module_name(path): path for path in sorted((REPO / package).rglob("*.py"))}


@functools.cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module name an import statement in the file names (relative imports resolved), but for those under
    `if TYPE_CHECKING:`, which never run."""
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(path, node.module, node.level)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return frozenset(names)


def _runtime_nodes(node: ast.AST):
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for stmt in child.orelse for n in _runtime_nodes(stmt))
        else:
            yield from _runtime_nodes(child)


def _absolute(path: Path, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    package = module_name(path).split(".")[:-1] if path.name != "__init__.py" else module_name(path).split(".")
    return ".".join(package[: len(package) - level + 1] + ([module] if module else []))


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_lower_package_imports_nothing_of_ours_above_it(package):
    allowed = {package, *ALLOWED[package]}
    wrong = sorted(f"{name} imports {imported}" for name, path in modules_of(package).items()
                   for imported in imports_of(path) if top(imported) in OURS and top(imported) not in allowed)
    assert not wrong, f"{package} may import only {sorted(allowed)}:\n" + "\n".join(wrong)


def _source(name: str) -> Path | None:
    """The file of one of our modules (a package's __init__.py), or None for a name that is no module of ours (an
    attribute imported with `from module import name`, or a third-party module)."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if top(name) in OURS and path.is_file():
            return path
    return None


def loaded_with(name: str) -> dict[str, str]:
    """Every module that importing `name` may load, each mapped to the module of ours that imports it: through the
    imports of our modules, transitively, and the packages above each one (their __init__.py run first)."""
    seen, todo = {name: "(start)"}, [name]
    while todo:
        current = todo.pop()
        parents = [".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)]
        path = _source(current)
        for imported in [*parents, *(imports_of(path) if path else ())]:
            if imported not in seen:
                seen[imported] = current
                todo.append(imported)
    return seen


def _chain(seen: dict[str, str], name: str) -> str:
    links = [name]
    while seen[links[-1]] != "(start)":
        links.append(seen[links[-1]])
    return " <- ".join(links)


@pytest.mark.parametrize("module", sorted(m for m in modules_of("decode_gpu") if m.startswith(TORCH_FREE)))
def test_the_engines_bookkeeping_loads_no_torch(module):
    seen = loaded_with(module)
    torch = sorted(name for name in seen if top(name) in ("torch", "triton", "transformers"))
    assert not torch, "\n".join(_chain(seen, name) for name in torch)


def test_the_layering_test_sees_lazy_imports(tmp_path):
    """An import inside a function counts: it would load torch as surely, only later."""
    path = tmp_path / "lazy.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import triton\n\n"
                    "def f():\n    import torch\n    from decode_gpu.kv import pool\n")
    assert imports_of(path) == {"typing", "typing.TYPE_CHECKING", "torch", "decode_gpu.kv", "decode_gpu.kv.pool"}


def test_the_torch_check_follows_imports_through_our_modules():
    """The engine process reaches torch only through decode_gpu's modules: the walk must get there."""
    seen = loaded_with("decode_gpu.service.server")
    assert "torch" in seen and "decode_gpu" in seen  # a package's __init__ runs before its modules
