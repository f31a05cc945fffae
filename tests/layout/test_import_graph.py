"""The import graph of the product packages (service/, tuner/, otel/), read from the source with ast.

Every import that can run counts, the ones inside functions too: a lazy import hides a circle from
the interpreter but not from a reader, and the next refactor that hoists it fails at start-up. Only
`if TYPE_CHECKING:` blocks are left out (they never run; annotations may name a caller's type). The
command-line package is the top of the graph: product modules raise service.errors.UsageError and
never import service.cli (only `moespec` itself, service/cli/, may).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "tuner", "otel")
GENERATED = "service.proto_gen"
CLI = "service.cli"  # the command line: the dispatcher and one module per subcommand, all in one package


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            if not name.startswith(GENERATED):
                modules[name] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST, typing: bool):
    """Every import node; without `typing`, those of `if TYPE_CHECKING:` blocks are left out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child) and not typing:
                stack.extend(child.orelse)  # the else branch does run
            else:
                stack.append(child)


def imported(path: Path, name: str, known: set[str], typing: bool = False) -> set[str]:
    """The product modules `path` (module `name`) imports: `from a.b import c` is a.b.c when that is
    a module, a.b otherwise; relative imports are resolved against the module's package. `typing`:
    count the imports that only annotations use too."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in _imports(ast.parse(path.read_text(), filename=str(path)), typing):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a package attribute: the module a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(modules: dict[str, Path], typing: bool = False) -> dict[str, set[str]]:
    known = set(modules)
    return {name: imported(path, name, known, typing) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def cli_importers(graph: dict[str, set[str]]) -> list[str]:
    def in_cli(module: str) -> bool:
        return module == CLI or module.startswith(CLI + ".")

    return sorted(f"{m} -> {t}" for m, targets in graph.items() if not in_cli(m) for t in targets if in_cli(t))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(product_modules())


def test_the_graph_covers_the_product_packages(graph):
    assert {"service.engine.engine", "service.server.servicer", "otel.api", "tuner"} <= set(graph)
    assert "otel.api" in graph["service.server.servicer"]  # a real edge is read


def test_no_import_circle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_circle_even_through_annotations():
    """A circle only annotations close is still one a reader walks (the scheduler once took the engine
    that made it): modules name their collaborators' types through what they are handed."""
    cycle = find_cycle(import_graph(product_modules(), typing=True))
    assert cycle is None, "import circle through annotations: " + " -> ".join(cycle)


def test_no_product_module_imports_the_command_line_package(graph):
    assert cli_importers(graph) == []


def test_the_servicer_gets_telemetry_only_through_otel_api(graph):
    otel_imports = {m for m in graph["service.server.servicer"] if m.split(".")[0] == "otel"}
    assert otel_imports == {"otel.api"}


def test_the_sglang_plugin_imports_nothing_of_the_server_side(graph):
    """It runs inside SGLang's scheduler process: only its own modules, and the server side reaches it
    through its wire format and the start-up check of its hook points alone."""
    plugin = {m for m in graph if m.startswith("service.sglang_plugin")}
    assert plugin and all(m.startswith("service.sglang_plugin") for p in plugin for m in graph[p])
    reached = {m for server in graph if server.startswith("service.sglang_backend") for m in graph[server]
               if m.startswith("service.sglang_plugin")}
    assert reached == {"service.sglang_plugin.wire", "service.sglang_plugin.hook_points"}


# -- the checker itself, on a small package written here: it must see what it claims to ------------

def write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {".".join(Path(rel).with_suffix("").parts).removesuffix(".__init__"): root / rel for rel in files}


def test_a_lazy_relative_import_circle_is_found(tmp_path):
    modules = write(tmp_path, {
        "service/__init__.py": "",
        "service/a.py": "from service import b\n",
        "service/b.py": "def f():\n    from .c import g\n",
        "service/c.py": "import service.a\n",
        "service/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from service.d import x\n",
        "service/d.py": "from service.a import x\nfrom service import e\n",
    })
    graph = import_graph(modules)
    assert graph["service.b"] == {"service.c"}
    assert graph["service.e"] == set()  # typing-only: never runs
    assert import_graph(modules, typing=True)["service.e"] == {"service.d"}
    assert find_cycle(graph) == ["service.a", "service.b", "service.c", "service.a"]
    del modules["service.c"]
    assert find_cycle(import_graph(modules)) is None


def test_an_import_of_the_cli_package_is_found(tmp_path):
    modules = write(tmp_path, {
        "service/cli/__init__.py": "from service.errors import UsageError\n",
        "service/cli/serve.py": "from service.cli import UsageError\n",
        "service/errors.py": "",
        "tuner/x.py": "def f():\n    from service.cli import UsageError\n",
        "service/cli/tune.py": "",
        "tuner/drivers/demo.py": "from service.cli.tune import dashboard_hint\n",
    })
    assert cli_importers(import_graph(modules)) == ["tuner.drivers.demo -> service.cli.tune", "tuner.x -> service.cli"]
