"""The import graph of ``ethen`` (read with stdlib ``ast``, every import: module-level, function-level and
``if TYPE_CHECKING``): no circle between modules, no upward import between packages, and no function-level
import except the few listed below with their reason.

The allowed direction is written once, in ``LAYERS``: a module may import its own package and any package
in a LATER layer, never one in an earlier layer. Known violations still being removed are listed in the
``KNOWN_*`` sets; the test also fails when a listed violation is gone, so the lists only ever shrink."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ethen"

# The layer rule, top to bottom: entry points -> admin -> gateway -> mesh -> store / model -> leaves. A
# module imports only its own package and the layers below it. A prefix names a package (or one module); the
# longest prefix that matches a module decides its layer. Packages of one layer do not import each other.
LAYERS: list[list[str]] = [
    ["ethen", "ethen.__main__", "ethen.cli", "ethen.up", "ethen.up_banner", "ethen.app", "ethen.gateway_cli"],
    ["ethen.admin"],
    ["ethen.gateway"],
    ["ethen.mesh"],
    ["ethen.store", "ethen.model"],
    ["ethen.paths", "ethen.aliases", "ethen.knobs"],  # leaves: import nothing of ethen
]

# Function-level imports that stay, each with its one-line reason: (importer, imported) -> reason.
_CLI = "start-up: `ethen --help` and the light sub-commands import only the command they run"
_WEIGHTS = "start-up: a heavy import (~0.5-1 s) paid only by the code path that reads/builds weights"
_MESH_STACK = "start-up: the mesh stack (gRPC, NumPy, the model) loads for a mesh provider / page only"
_UP = "start-up: `ethen up` imports the gateway, mesh and model parts on the path it runs only"
_GATEWAY_CLI = "start-up: `ethen gateway --hash-key` and bad flags answer before the app loads"
_WORKER_CLI = "start-up: the worker sets its BLAS thread defaults before NumPy loads"
LAZY_ALLOWED: dict[tuple[str, str], str] = {
    ("ethen.cli", "ethen.admin.cli"): _CLI,
    ("ethen.cli", "ethen.gateway_cli"): _CLI,
    ("ethen.cli", "ethen.mesh.cli"): _CLI,
    ("ethen.cli", "ethen.mesh.worker.cli"): _CLI,
    ("ethen.cli", "ethen.up"): _CLI,
    ("ethen.gateway.catalog.loader", "genai_prices"): "start-up: price snapshot parsed on a fallback only",
    ("ethen.gateway.accounting.pricing", "genai_prices"): "start-up: price snapshot read on first answer",
    ("ethen.gateway.config.build", "genai_prices"): "start-up: cache-read price ratios read once per route",
    ("ethen.gateway.observation.tracing", "opentelemetry"): "optional: the OTLP exporter, [otel] only",
    ("ethen.model.engine", "onnxruntime"): _WEIGHTS,
    ("ethen.model.gguf_loader", "gguf"): _WEIGHTS,
    ("ethen.model.gguf_loader", "tokenizers"): _WEIGHTS,
    ("ethen.model.qmodel", "gguf"): _WEIGHTS,
    ("ethen.model.glayer", "gguf"): _WEIGHTS,
    ("ethen.model.gqhead", "gguf"): _WEIGHTS,
    ("ethen.model.qhead", "numba"): _WEIGHTS,
    ("ethen.model.attend", "numba"): _WEIGHTS,
    ("ethen.model.tiny_gguf", "gguf"): _WEIGHTS,
    ("ethen.admin.observe_data", "ethen.gateway.providers.mesh"): _MESH_STACK,
    ("ethen.gateway.config.providers", "ethen.mesh.auth"): "start-up: gRPC loads only to check a mesh join",
    ("ethen.gateway.providers", "ethen.gateway.providers.mesh"): _MESH_STACK,
    ("ethen.gateway_cli", "ethen.app"): _GATEWAY_CLI,
    ("ethen.gateway_cli", "ethen.gateway.accounting.auth"): _GATEWAY_CLI,
    ("ethen.gateway_cli", "ethen.gateway.api.serve"): _GATEWAY_CLI,
    ("ethen.gateway_cli", "ethen.gateway.catalog"): _GATEWAY_CLI,
    ("ethen.gateway_cli", "ethen.gateway.config"): _GATEWAY_CLI,
    ("ethen.gateway_cli", "ethen.gateway.observation.logformat"): _GATEWAY_CLI,
    ("ethen.gateway_cli", "ethen.mesh.worker.launch"): _GATEWAY_CLI,
    ("ethen.mesh.cli", "ethen.mesh.certs"): "start-up: cryptography loads for `ethen mesh certs` only",
    ("ethen.mesh.worker.cli", "ethen.mesh.auth"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.mesh.model_id"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.mesh.worker.backend"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.mesh.worker.launch"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.mesh.worker.membership"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.mesh.worker.server"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.mesh.worker.config"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.model"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.model.errors"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.model.gguf_loader"): _WORKER_CLI,
    ("ethen.mesh.worker.cli", "ethen.model.model"): _WORKER_CLI,
    ("ethen.up", "ethen.app"): _UP,
    ("ethen.up", "ethen.gateway.accounting.auth"): _UP,
    ("ethen.up", "ethen.gateway.api.serve"): _UP,
    ("ethen.up", "ethen.gateway.catalog"): _UP,
    ("ethen.up", "ethen.gateway.config"): _UP,
    ("ethen.up", "ethen.gateway.errors"): _UP,
    ("ethen.up", "ethen.gateway.observation.logformat"): _UP,
    ("ethen.up_checks", "ethen.gateway.config"): _UP,
    ("ethen.up_checks", "ethen.gateway.errors"): _UP,
    ("ethen.up_checks", "ethen.mesh.auth"): _UP,
    ("ethen.up_config", "ethen.gateway.accounting.auth"): _UP,
    ("ethen.up_config", "ethen.gateway.catalog"): _UP,
    ("ethen.up_config", "ethen.gateway.config"): _UP,
    ("ethen.up_config", "ethen.gateway.providers.mesh"): _UP,
    ("ethen.up_config", "tomli_w"): _UP,
    ("ethen.up_layout", "ethen.mesh.orchestrator.planning"): _UP,
    ("ethen.up_layout", "ethen.mesh.routing"): _UP,
    ("ethen.up", "ethen.mesh.worker.cli"): _UP,
    ("ethen.up_layout", "ethen.mesh.worker.config"): _UP,
    ("ethen.up", "ethen.mesh.worker.supervisor"): _UP,
    ("ethen.up", "ethen.model.errors"): _UP,
    ("ethen.up", "ethen.model.gguf_loader"): _UP,
    ("ethen.up", "ethen.up_banner"): _UP,
    ("ethen.up_state", "ethen.gateway.accounting.auth"): _UP,
    ("ethen.up_state", "ethen.store"): _UP,
    ("ethen.up", "rich"): _UP,
}

# Violations that exist today and are being removed (the lists must end empty).
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_LAZY: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    lazy: bool  # inside a function body


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _walk(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inner)


def _edges() -> list[Edge]:
    modules = _modules()
    edges: list[Edge] = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node, lazy in _walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                # the longest known module the name starts with (``import a.b.c`` where c is an attribute)
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append(Edge(name, target, lazy))
    return edges


def _layer(module: str) -> tuple[int, str]:
    best = (-1, "", -1)
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[2]:
                best = (rank, prefix, len(prefix))
    assert best[0] >= 0, f"{module} is in no layer of LAYERS"
    return best[0], best[1]


def _cycles(edges: list[Edge]) -> set[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: set[frozenset[str]] = set()
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp: set[str] = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.add(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.add(frozenset(comp))
    return out


def _upward(edges: list[Edge]) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    for e in edges:
        (rank_from, pkg_from), (rank_to, pkg_to) = _layer(e.importer), _layer(e.imported)
        if rank_to < rank_from or (rank_to == rank_from and pkg_from != pkg_to and rank_from > 0):
            out.add((e.importer, e.imported))
    return out


def _lazy_imports() -> set[tuple[str, str]]:
    """(importer, imported) for every import inside a function: an ``ethen`` module, or the top-level
    package of anything else (``gguf``, ``onnx``, ``socket``)."""
    modules = _modules()
    out: set[tuple[str, str]] = set()
    for edge in _edges():
        if edge.lazy:
            out.add((edge.importer, edge.imported))
    for name, path in modules.items():
        for node, lazy in _walk(ast.parse(path.read_text(), str(path))):
            if not lazy:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = [_resolve(name, path.name == "__init__.py", node)]
            out.update((name, n.split(".")[0]) for n in names if n.split(".")[0] != "ethen")
    return out


def test_the_walk_sees_the_package() -> None:
    edges = _edges()
    assert len(_modules()) > 100 and len(edges) > 300
    assert Edge("ethen.cli", "ethen.up", False) in edges or any(e.importer == "ethen.cli" for e in edges)


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = [Edge("a", "b", False), Edge("b", "c", False), Edge("c", "a", True), Edge("c", "d", False)]
    assert _cycles(edges) == {frozenset({"a", "b", "c"})}


def test_no_import_circles() -> None:
    found = _cycles(_edges())
    new = {tuple(sorted(c)) for c in found - KNOWN_CYCLES}
    gone = {tuple(sorted(c)) for c in KNOWN_CYCLES - found}
    assert not new, f"import circles: {sorted(new)}"
    assert not gone, f"fixed circles still listed in KNOWN_CYCLES: {sorted(gone)}"


def test_imports_only_run_down_the_layers() -> None:
    found = _upward(_edges())
    assert not found - KNOWN_UPWARD, f"upward imports (see LAYERS): {sorted(found - KNOWN_UPWARD)}"
    assert not KNOWN_UPWARD - found, f"fixed, still listed in KNOWN_UPWARD: {sorted(KNOWN_UPWARD - found)}"


def test_function_level_imports_are_only_the_allowed_ones() -> None:
    found = _lazy_imports()
    allowed = set(LAZY_ALLOWED) | KNOWN_LAZY
    assert not found - allowed, f"function-level imports: {sorted(found - allowed)}"
    assert not allowed - found, f"listed but gone: {sorted(allowed - found)}"
    assert all(reason.strip() for reason in LAZY_ALLOWED.values())
