"""The code's shape, checked from its source: no import cycles inside toolkit/ (type-only imports under
`if TYPE_CHECKING:` counted: a hint that names a class above is still a dependency on it), lower layers that
import nothing of the orchestration above them, and no class a reader cannot hold in their head."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "toolkit"
# The packages from the bottom up (docs/architecture.md draws them): a module imports from its own layer or the
# layers below, never above, type hints included. Within a layer, the cycle check below keeps the order.
LAYERS = (
    ("toolkit.errors", "toolkit.paths", "toolkit.version", "toolkit.data", "toolkit.config"),  # leaves
    ("toolkit.native",),  # the C kernels: build, CPU detection, ops, sha256 of rows, child processes
    ("toolkit.sampling",),  # SamplingParams, the processors, the sampler, RNG, grammar masks, stop strings
    ("toolkit.kv",),  # KV-cache memory and attention over it
    ("toolkit.models",),  # decoders, loading, tokenizer, the uncached reference forward
    ("toolkit.trace",),  # the SampleTrace schema, writer and reader
    ("toolkit.engine",),  # intake -> scheduler -> runner -> decide -> commit -> outputs
    ("toolkit.runs", "toolkit.llm"),  # a recorded run: session, manifest, workloads, metrics, plots, loggers
    ("toolkit.report",),
    ("toolkit.serve",),
    ("toolkit.audit",),
    ("toolkit.bench",),
    ("toolkit.modes", "toolkit.__main__", "toolkit"),  # what run.py dispatches to; the package's entry points
)
MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 500
# a toolkit import inside a function: only where `import toolkit` must stay light (no torch for --help), or of a
# module that needs an optional extra (its line says which: `# deferred: ... the [serve] extra ...`)
LAZY_TOOLKIT_IMPORTS = {"toolkit/__init__.py"}
EXTRA = re.compile(r"# deferred: .*\[\w+\] extra")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        name = ".".join(("toolkit", *path.relative_to(root).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the toolkit modules it imports, at module level, inside a function (a lazy import is still a
    dependency) or under `if TYPE_CHECKING:` (so is a type hint: a lower layer states what it needs as a Protocol
    of its own, as toolkit.runs.workload.AcceptsRequests and toolkit.engine.speculative.DraftHost do)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_no_import_cycles_inside_toolkit():
    assert cycles(import_graph(modules())) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check itself can fail: a package whose kernels reach back to the models through a lazy import
    (the cycle this code base had) is reported."""
    pkg = tmp_path / "toolkit"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text("def f():\n    from toolkit.models.loading import cache_root\n")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "loading.py").write_text("from toolkit.models import decoder\n")
    (pkg / "models" / "decoder.py").write_text("from toolkit import kernels\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toolkit import kernels\n")
    assert cycles(import_graph(modules(pkg))) == [["toolkit.kernels", "toolkit.models.decoder",
                                                   "toolkit.models.loading"]]


def test_a_type_only_import_upward_is_a_cycle_too(tmp_path):
    """A lower module naming the engine in a hint under TYPE_CHECKING (what speculative.py did) is reported."""
    pkg = tmp_path / "toolkit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from toolkit import speculative\n")
    (pkg / "speculative.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from toolkit.engine import Engine\n")
    assert cycles(import_graph(modules(pkg))) == [["toolkit.engine", "toolkit.speculative"]]


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module` (`toolkit` alone is the top)."""
    best = max(((len(p), i) for i, names in enumerate(LAYERS) for p in names
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_dependencies_point_down_only():
    assert upward_imports(import_graph(modules())) == []


def test_an_upward_import_is_found(tmp_path):
    """The check itself can fail: a sampler that names the engine in a type hint reaches above its layer."""
    pkg = tmp_path / "toolkit"
    (pkg / "sampling").mkdir(parents=True)
    (pkg / "engine").mkdir()
    for init in (pkg, pkg / "sampling", pkg / "engine"):
        (init / "__init__.py").write_text("")
    (pkg / "engine" / "core.py").write_text("from toolkit.sampling import sampler\n")
    (pkg / "sampling" / "sampler.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from toolkit.engine.core import Engine\n")
    assert upward_imports(import_graph(modules(pkg))) == ["toolkit.sampling.sampler -> toolkit.engine.core"]


def function_level_imports(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(file, line, module, the line) of every import inside a function."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    where = str(path.relative_to(root.parent))
                    found.append((where, node.lineno, module or "", lines[node.lineno - 1]))
    return found


def test_imports_sit_at_module_top():
    """Inside a function only a heavy optional dependency, with a `# deferred: <what>` comment on its line; no
    toolkit module except in the package's light entry point."""
    inside = function_level_imports()
    toolkit_inside = [f"{f}:{n} {m}" for f, n, m, line in inside
                      if m.split(".")[0] == "toolkit" and f not in LAZY_TOOLKIT_IMPORTS and not EXTRA.search(line)]
    unsaid = [f"{f}:{n} {m}" for f, n, m, line in inside if not re.search(r"# deferred: \S", line)]
    assert toolkit_inside == [], toolkit_inside
    assert unsaid == [], unsaid


def test_no_class_is_too_long_to_read():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_no_module_is_too_long_to_read():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    over = sorted(f"{name} ({n} lines)" for name, n in lengths.items() if n > MAX_MODULE_LINES)
    assert not over, f"over {MAX_MODULE_LINES} lines: {over}"
