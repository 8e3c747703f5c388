"""The code's shape, checked from its source: no import cycles inside toolkit/ (type-only imports under
`if TYPE_CHECKING:` counted: a hint that names a class above is still a dependency on it), lower layers that
import nothing of the orchestration above them, and no class a reader cannot hold in their head."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1] / "toolkit"
# The packages from the bottom up (docs/architecture.md draws them): a module imports from its own layer or the
# layers below, never above, type hints included. Within a layer, the cycle check below keeps the order.
LAYERS = (
    (
        "toolkit.errors",
        "toolkit.paths",
        "toolkit.version",
        "toolkit.data",
        "toolkit.config",
        "toolkit.devices",
    ),  # leaves
    ("toolkit.native",),  # the C kernels: build, CPU detection, ops, sha256 of rows, child processes
    ("toolkit.sampling",),  # SamplingParams, the processors, the sampler, RNG, grammar masks, stop strings
    ("toolkit.kv",),  # KV-cache memory and attention over it
    ("toolkit.models",),  # decoders, loading, tokenizer, the uncached reference forward
    ("toolkit.trace",),  # the SampleTrace schema, writer and reader
    ("toolkit.engine",),  # intake -> scheduler -> runner -> decide -> commit -> outputs
    ("toolkit.runs", "toolkit.llm"),  # a recorded run: session, manifest, workloads, metrics, plots, loggers
    ("toolkit.report",),
    ("toolkit.serve",),
    ("toolkit.reproduce",),  # our own runs: replay, verify, compare (and the Ray sharding verify and the audit share)
    ("toolkit.audit",),  # other engines' transcripts
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
    (pkg / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toolkit import kernels\n"
    )
    assert cycles(import_graph(modules(pkg))) == [
        ["toolkit.kernels", "toolkit.models.decoder", "toolkit.models.loading"]
    ]


def test_a_type_only_import_upward_is_a_cycle_too(tmp_path):
    """A lower module naming the engine in a hint under TYPE_CHECKING (what speculative.py did) is reported."""
    pkg = tmp_path / "toolkit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from toolkit import speculative\n")
    (pkg / "speculative.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toolkit.engine import Engine\n"
    )
    assert cycles(import_graph(modules(pkg))) == [["toolkit.engine", "toolkit.speculative"]]


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module` (`toolkit` alone is the top)."""
    best = max(
        ((len(p), i) for i, names in enumerate(LAYERS) for p in names if module == p or module.startswith(p + ".")),
        default=None,
    )
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
    (pkg / "sampling" / "sampler.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toolkit.engine.core import Engine\n"
    )
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
    toolkit_inside = [
        f"{f}:{n} {m}"
        for f, n, m, line in inside
        if m.split(".")[0] == "toolkit" and f not in LAZY_TOOLKIT_IMPORTS and not EXTRA.search(line)
    ]
    unsaid = [f"{f}:{n} {m}" for f, n, m, line in inside if not re.search(r"# deferred: \S", line)]
    assert toolkit_inside == [], toolkit_inside
    assert unsaid == [], unsaid


# a step's modules: what they send to a GPU goes through toolkit.devices (page-locked memory, non-blocking), since a
# plain copy from pageable memory waits for every kernel queued before it (async scheduling's queued step too)
STEP_MODULES = (
    "engine/ahead.py",
    "engine/core.py",
    "engine/decide.py",
    "engine/graphs.py",
    "engine/runner.py",
    "engine/scheduler.py",
    "kv/attention.py",
    "models/decoder.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "sampling").rglob("*.py"))),
)


def _torch_call(node: ast.AST, names: tuple[str, ...]) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def waiting_copies(path: Path) -> list[str]:
    """Host values copied to a device from pageable memory: torch.tensor / torch.as_tensor with a device, and a
    tensor built from host values (torch.tensor, torch.from_numpy) moved with .to(...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        made_there = _torch_call(node, ("tensor", "as_tensor")) and any(k.arg == "device" for k in node.keywords)
        moved = (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "to"
            and _torch_call(node.func.value, ("tensor", "as_tensor", "from_numpy"))
        )
        if made_there or moved:
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_a_steps_host_values_reach_the_device_without_waiting_for_it(tmp_path):
    """No step module builds a device tensor from host values with torch.tensor(..., device=...): on a GPU that copy
    waits for the queue to drain (toolkit/devices.py's tensor_on does not). The check finds one."""
    assert [f for m in STEP_MODULES for f in waiting_copies(ROOT / m)] == []
    (tmp_path / "bad.py").write_text(
        "import torch\nx = torch.tensor([1, 2], dtype=torch.int64, device='cuda')\ny = torch.from_numpy(a).to(d)\n"
    )
    assert waiting_copies(tmp_path / "bad.py") == ["bad.py:2", "bad.py:3"]


def middle_axis_products(path: Path) -> list[str]:
    """Where a Triton kernel sums a product of two 3-d broadcasts over axis 1 (`tl.sum(a[:, :, None] * b[None, :, :],
    axis=1)`): Triton's combine pass compiles that, with 16 rows and columns or more, as a tl.dot at TF32 on a GPU
    (an H200 found the attention 1.4e-3 off in fp32 so)."""

    def three_d(node: ast.AST) -> bool:
        return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 3

    found, lines = [], path.read_text().splitlines()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.sum" and node.args):
            continue
        if lines[node.lineno - 1].endswith("# under 16 rows"):  # a branch taken only where the pass cannot match
            continue
        axis = [k.value for k in node.keywords if k.arg == "axis"] or node.args[1:2]
        product = node.args[0]
        if (
            axis
            and isinstance(axis[0], ast.Constant)
            and axis[0].value == 1
            and isinstance(product, ast.BinOp)
            and isinstance(product.op, ast.Mult)
            and three_d(product.left)
            and three_d(product.right)
        ):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_triton_kernel_sums_a_broadcast_product_over_its_middle_axis(tmp_path):
    """No kernel of ours writes the multiply-and-sum that Triton compiles to a TF32 tile product (fp32 kept
    exact: issue 57); the attention's 16-head programs and the tl.sum matmul reduce the last axis, and a line marked
    `# under 16 rows` runs only where the pass cannot match. The check finds one."""
    assert [f for p in sorted((ROOT / "native").glob("*.py")) for f in middle_axis_products(p)] == []
    (tmp_path / "bad.py").write_text(
        "acc = tl.sum(w[:, :, None] * v[None, :, :], axis=1)\nok = tl.sum(w[:, None, :] * v[None, :, :], axis=2)\n"
        "small = tl.sum(w[:, :, None] * v[None, :, :], axis=1)  # under 16 rows\n"
    )
    assert middle_axis_products(tmp_path / "bad.py") == ["bad.py:1"]


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


# the engine's narrow API (toolkit/engine/core.py and queries.py): add, abort, step, output, release and the
# queries. Outside toolkit/engine nothing reaches into its parts: an attribute of these names read off an engine
# (a name or attribute that says `engine`) is a reach.
ENGINE_INTERNALS = {"scheduler", "block_manager", "requests", "groups", "intake", "runner", "committer", "decider"}


def engine_reaches(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                owner = (
                    node.value.id
                    if isinstance(node.value, ast.Name)
                    else node.value.attr
                    if isinstance(node.value, ast.Attribute)
                    else ""
                )
                if "engine" in owner.lower():
                    found.append(f"{path.relative_to(root)}:{node.lineno} {owner}.{node.attr}")
    return found


def test_nothing_outside_the_engine_reaches_into_it(tmp_path):
    assert engine_reaches() == []
    planted = tmp_path / "serve"
    planted.mkdir()
    (planted / "loop.py").write_text("def running(self):\n    return len(self.engine.scheduler.running)\n")
    assert engine_reaches(tmp_path) == ["serve/loop.py:2 engine.scheduler"]


# where two runs part is computed in one place (toolkit/trace/diverge.py); replay, the report, compare and the
# studies call it. A function or class whose name says it finds a divergence or a differing field, elsewhere, is
# a second implementation.
DIVERGENCE_NAME = re.compile(r"(?i)^_?(first_diverg|first_differ|differing|divergence$|row_differences|cause_of)")


def divergence_definitions(root: Path = ROOT) -> list[str]:
    return sorted(
        f"{path.relative_to(root)}:{node.name}"
        for path in root.rglob("*.py")
        if path.relative_to(root) != Path("trace/diverge.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and DIVERGENCE_NAME.search(node.name)
    )


def test_the_first_divergence_has_one_implementation(tmp_path):
    assert divergence_definitions() == []
    planted = tmp_path / "reproduce"
    planted.mkdir()
    (planted / "compare.py").write_text("def _first_divergence(a, b):\n    return 0\n\nclass Divergence:\n    pass\n")
    assert divergence_definitions(tmp_path) == [
        "reproduce/compare.py:Divergence",
        "reproduce/compare.py:_first_divergence",
    ]


# --------------------------------------------------------------------------- the numerics marker
TESTS = Path(__file__).resolve().parent
# a SmolLM2 test that decodes greedily (or compares greedy tokens)...
GREEDY = re.compile(r"temperature=0(\.0)?\b|hf_greedy|greedy_with_margins|assert_greedy_agreement")
# ...carries @pytest.mark.numerics (make test reruns it as older CPUs round: .ci/older_cpus.py), unless what it
# compares is one computation by design, said here
ONE_COMPUTATION = {
    "test_attention.py::test_fused_layers_on_smollm2_bit_for_bit": "fused vs unfused native layers: the same sums",
    "test_report.py::test_a_sampling_change_is_named_noise_or_support": "divergence causes found within its runs",
    "test_serve.py::test_completion_is_what_the_engine_computes": "the server's engine vs the same engine",
    "test_serve.py::test_token_id_prompts_batches_and_n": "greedy choices of one request compared to each other",
    "test_serve.py::test_chat_logprobs_are_a_distribution_and_name_the_chosen_token": "within one response",
    "test_serve.py::test_streaming_gives_the_same_text_and_usage": "one engine, streamed vs not",
    "test_serve.py::test_response_format_json_schema_and_json_object_are_valid_json": "validity, not agreement",
    "test_serve.py::test_bad_json_and_the_server_still_serves": "a count of tokens, not which",
    "test_serve.py::test_prompt_logprobs_with_echo_match_generation": "one engine's prefill vs its decode",
    "test_serve.py::test_echo_with_max_tokens_0_answers_the_prompt_scored_alone": "one engine's prompt scores, twice",
    "test_serve.py::test_a_served_run_is_traced_replayed_bit_identical_and_verified": "replay of its own run",
}


def _marks(fn: ast.FunctionDef) -> set[str]:
    return {m.group(1) for d in fn.decorator_list if (m := re.match(r"pytest\.mark\.(\w+)", ast.unparse(d)))}


def smollm2_greedy_tests(root: Path = TESTS) -> dict[str, bool]:
    """'file::test' -> whether it carries the numerics marker, for every test that uses SmolLM2 (the `smollm2`
    fixture or SMOLLM2) and decodes greedily, in its own body or in a module-level helper or fixture it reaches."""
    found = {}
    for path in sorted(root.glob("test_*.py")):
        if path.name == Path(__file__).name:  # this file plants such tests as text
            continue
        text = path.read_text()
        funcs = {n.name: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}

        def reach(name: str, seen: set[str]) -> None:
            if name in funcs and name not in seen:
                seen.add(name)
                for node in [*funcs[name].args.args, *ast.walk(funcs[name])]:
                    reach(node.arg if isinstance(node, ast.arg) else getattr(node, "id", ""), seen)

        for name, fn in funcs.items():
            if name.startswith("test_"):
                seen: set[str] = set()
                reach(name, seen)
                body = "\n".join(ast.get_source_segment(text, funcs[s]) or "" for s in seen)
                uses = "SMOLLM2" in body or any(a.arg == "smollm2" for s in seen for a in funcs[s].args.args)
                if uses and GREEDY.search(body):
                    found[f"{path.name}::{name}"] = "numerics" in _marks(fn)
    return found


def test_every_smollm2_greedy_agreement_test_is_rerun_as_older_cpus_round():
    found = smollm2_greedy_tests()
    assert {t for t, marked in found.items() if not marked and t not in ONE_COMPUTATION} == set()
    assert set(ONE_COMPUTATION) <= set(found), "a test named in ONE_COMPUTATION is gone or no longer greedy"
    assert sum(found.values()) >= 4


def test_the_marker_check_finds_an_unmarked_greedy_test(tmp_path):
    (tmp_path / "test_planted.py").write_text(
        "import pytest\n\ndef run(smollm2):\n    return SamplingParams(temperature=0.0)\n\n"
        "def test_planted(smollm2):\n    assert run(smollm2) == run(smollm2)\n\n"
        "@pytest.mark.numerics\ndef test_marked(smollm2):\n    assert run(smollm2)\n\n"
        "def test_sampled(smollm2):\n    assert SamplingParams(temperature=1.0)\n"
    )
    assert smollm2_greedy_tests(tmp_path) == {
        "test_planted.py::test_planted": False,
        "test_planted.py::test_marked": True,
    }


# --------------------------------------------------------------------------- the native marker
PLANTED_NATIVE = """
import pytest
from tests.conftest import make_engine, native_only
from toolkit.config import ModelConfig
from toolkit.models import load_model


def test_steps_an_engine_unmarked():
    engine = make_engine(load_model(ModelConfig(name="tiny", seed=0, vocab_size=64)))
    engine.generate([{"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}])


@pytest.mark.native
def test_steps_an_engine_marked():
    test_steps_an_engine_unmarked()


@native_only
def test_steps_an_engine_under_native_only():
    test_steps_an_engine_unmarked()


def test_reads_a_config():
    assert ModelConfig(name="tiny").num_layers == 2


def test_steps_an_engine_with_the_kernels_switched_off_itself_unmarked(monkeypatch):
    monkeypatch.setenv("TOOLKIT_NATIVE", "0")
    test_steps_an_engine_unmarked()
"""


@pytest.mark.native  # it runs the planted tests in a child pytest, which asks toolkit.native
def test_a_test_that_takes_the_native_path_unmarked_fails(tmp_path):
    """make test-fallback reruns only tests marked `native`; the suite's conftest fails a test that takes a path
    TOOLKIT_NATIVE=0 changes (an engine's forward) without the marker, and passes one that does not, one that
    switches the kernels off itself (it takes the fallback's path in both runs), or one under `native_only`."""
    planted = TESTS / "test_zz_planted_native.py"
    planted.write_text(PLANTED_NATIVE)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                str(planted),
                "--basetemp",
                str(tmp_path / "base"),
            ],
            cwd=TESTS.parent,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "TOOLKIT_NATIVE": "1", "TOOLKIT_NATIVE_REPORT": ""},
        )
    finally:
        planted.unlink()
    out = result.stdout
    assert "5 passed, 1 error" in out, out[-3000:]  # native_only marks its test native (tests/conftest.py)
    assert "ERROR tests/test_zz_planted_native.py::test_steps_an_engine_unmarked" in out
    assert "is not marked `native`" in out


def test_pytest_loads_the_conftest_the_suite_imports(request):
    """tests/ is a package, so the conftest whose hooks and fixtures pytest runs is the module the test files import
    helpers from (`from tests.conftest import ...`), and a test module another imports is loaded once. Without
    tests/__init__.py pytest loads `conftest` and `test_grammar` beside a second `tests.conftest` and `tests.test_grammar`
    (nine modules twice)."""
    assert conftest in request.config.pluginmanager.get_plugins()
    assert "conftest" not in sys.modules
