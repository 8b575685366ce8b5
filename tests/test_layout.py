"""The package layout shows the architecture, and the import graph keeps it so.

Read from the source (no imports executed): every ``import`` of a specbatch module,
top-level or inside a function (a lazy import still ties two modules together), except
those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "specbatch"
LAYERS = ("runtime", "kernels", "serving", "tools", "testing")
# The machine and the data it reads: no MLX, no kernel (the chart tool and other servers'
# schedulers load them without MLX).
PURE = {"machine", "scheduler", "plan", "request", "output", "params", "schedule", "stats", "detok", "tree_shape",
        "policy", "book", "cost", "admission", "config", "moves"}
# The composition root: it alone builds the engine (and its core) over the kernels.
ROOT = "specbatch.kernels.build"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path, known: set[str]) -> set[str]:
    """specbatch modules (and ``mlx``) that ``path`` imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in known)
            visit(child)

    visit(ast.parse(path.read_text()))
    out = {m for m in found if m in known}
    out.update("mlx" for m in found if m == "mlx" or m.startswith("mlx."))
    out.discard(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    known = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, known) for p in paths}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None


def test_each_layer_is_a_folder():
    for name in LAYERS:
        assert (PACKAGE / name / "__init__.py").exists(), name
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "blas", "errors", "logs", "openblas"]  # the package's foundation only


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state and (found := walk(w)):
                return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := walk(v)):
            return found
    return None


def test_no_import_cycles(graph):
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_and_kernels_never_import_serving_or_tools(graph):
    for module, deps in graph.items():
        if layer(module) in ("runtime", "kernels", "testing"):
            bad = sorted(d for d in deps if layer(d) in ("serving", "tools"))
            assert not bad, f"{module} imports {bad}"


def test_the_machine_and_its_data_import_no_mlx_and_no_kernel(graph):
    pure = {f"specbatch.runtime.{m}" for m in PURE}
    assert pure <= set(graph)
    for module in pure:
        deps = graph[module]
        assert "mlx" not in deps, module
        assert deps <= pure | {"specbatch.errors", "specbatch.runtime"}, f"{module}: {sorted(deps - pure)}"


def test_the_runtime_imports_no_mlx_and_no_kernel(graph):
    """The whole runtime, the core and the engine thread included: kernels are handed in."""
    runtime = [m for m in graph if layer(m) == "runtime" or m == "specbatch.runtime"]
    assert "specbatch.runtime.core" in runtime and "specbatch.runtime.engine" in runtime
    for module in runtime:
        deps = graph[module]
        assert "mlx" not in deps, module
        bad = sorted(d for d in deps if layer(d) == "kernels")
        assert not bad, f"{module} imports {bad}"


def test_kernels_read_only_the_cores_data(graph):
    pure = {f"specbatch.runtime.{m}" for m in PURE}
    for module, deps in graph.items():
        if layer(module) == "kernels" and module != ROOT:
            bad = sorted(d for d in deps if layer(d) == "runtime" and d not in pure)
            assert not bad, f"{module} imports {bad}"


def test_architecture_doc_names_every_module():
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(SRC.parent)) for p in PACKAGE.rglob("*.py")
               if "__pycache__" not in p.parts and (p.name != "__init__.py" or p.parent == PACKAGE)
               and f"`{p.relative_to(SRC.parent)}`" not in doc]
    assert not missing, f"docs/architecture.md lacks {missing}"


def test_sizes_a_reviewer_reads_in_an_afternoon():
    """No module over 300 lines, no function over 50, the machine under 220 (issue 24)."""
    long_modules, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if len(source.splitlines()) > 300:
            long_modules.append(str(path.relative_to(SRC)))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                long_functions.append(f"{path.relative_to(SRC)}:{node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)
    assert len((PACKAGE / "runtime" / "machine.py").read_text().splitlines()) < 220


def test_engine_config_has_at_most_14_fields_and_takes_each_setting_by_name():
    import attrs

    from specbatch.runtime.config import GROUPS, EngineConfig
    assert len(attrs.fields(EngineConfig)) <= 14
    config = EngineConfig(kv_layout="paged", prefill_chunk=16, fixed_draft=True, rearm_patience=2)
    assert (config.memory.kv_layout, config.prefill.prefill_chunk, config.drafts.fixed_draft,
            config.rearm.rearm_patience) == ("paged", 16, True, 2)
    assert attrs.evolve(config, kv_bits=8).memory == attrs.evolve(config.memory, kv_bits=8)
    assert EngineConfig(**attrs.asdict(config)) == config  # a config over the wire
    assert set(GROUPS) <= {f.name for f in attrs.fields(EngineConfig)}
