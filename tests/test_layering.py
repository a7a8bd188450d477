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


# edge/'s rooms (docs/architecture.md, "edge/"): folder -> the folders of edge it may import (itself always). The root
# modules (cli, app, config, state) sit on top and may import any room; `config` is also open to every room below.
EDGE_ROOMS = {
    "chat": (),
    "api": ("chat",),
    "core": ("api", "chat", "config"),
    "observe": ("core", "api", "chat", "config"),
    "launch": ("core", "api", "chat", "config"),
    "check_model": ("config",),
    "models": ("core", "api", "chat", "observe", "launch", "config"),  # the registry and each model's stack
    "http": ("core", "api", "chat", "observe", "config", "state", "models"),
}
ROOT_MODULES = ("edge", "edge.cli", "edge.app", "edge.config", "edge.state")


def room(name: str) -> str:
    """edge.core.gateway -> core; edge.config -> config; edge -> edge."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_edge_has_rooms_and_few_modules_at_its_root():
    rooms = sorted(p.name for p in (REPO / "edge").iterdir() if (p / "__init__.py").is_file())
    flat = sorted(p.name for p in (REPO / "edge").glob("*.py") if p.name != "__init__.py")
    assert len(rooms) >= 6 and set(EDGE_ROOMS) <= set(rooms), rooms
    assert len(flat) <= 6, flat
    assert {f"edge.{p[:-3]}" for p in flat} <= set(ROOT_MODULES), flat


@pytest.mark.parametrize("folder", sorted(EDGE_ROOMS))
def test_an_edge_room_imports_only_the_rooms_below_it(folder):
    allowed = {folder, *EDGE_ROOMS[folder]}
    wrong = []
    for name, path in modules_of(f"edge/{folder}").items():
        for imported in imports_of(path):
            if top(imported) == "edge" and imported != "edge" and _source(imported) and room(imported) not in allowed:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, f"edge.{folder} may import only {sorted(allowed)} of edge:\n" + "\n".join(sorted(wrong))


def test_only_check_model_imports_the_engine():
    wrong = sorted(f"{name} imports {imported}" for name, path in modules_of("edge").items()
                   if not name.startswith("edge.check_model") for imported in imports_of(path)
                   if top(imported) == "decode_gpu")
    assert not wrong, "\n".join(wrong)


def import_graph(packages) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (lazy imports too; a package's __init__ only where named)."""
    graph = {}
    for package in packages:
        for name, path in modules_of(package).items():
            graph[name] = {imported for imported in imports_of(path) if _source(imported) and imported != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
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
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_outside_bench():
    found = circles(import_graph([p for p in OURS if p != "bench"]))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)
