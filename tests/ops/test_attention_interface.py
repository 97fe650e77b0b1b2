"""The attention-backend seams are declared, not discovered: no import cycle among the modules of
`phloem.ops.attention` (the interface imports no backend), no caller probing a backend with
getattr/hasattr/inspect.signature, no module attribute replaced at run time, and every backend
implementing the whole interface."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import phloem
from phloem.ops.attention import AttentionBackend, DecodePath, DecodePlan, get_attention_backend
from phloem.ops.attention.reference import ReferenceAttention
from phloem.ops.attention.shared_prefix import SharedPrefixAttention

PACKAGE = Path(phloem.__file__).parent
ATTENTION = PACKAGE / "ops" / "attention"
PREFIX = "phloem.ops.attention"
BACKEND_MODULES = {"reference", "flashinfer_backend", "shared_prefix", "shared_prefix_flashinfer",
                   "shared_prefix_triton", "decode_graph_plan", "prefill_split"}  # fmt: skip
# the files that hold or call attention backends
CALLERS = ["worker/model_runner.py", "worker/cuda_graph.py", "worker/worker.py",
           "worker/verify_graph.py", "worker/piecewise_graph.py",
           "layers/attention.py", "forward_context.py", "entrypoints/bench.py"]  # fmt: skip


def _modules() -> list[str]:
    return sorted(p.stem for p in ATTENTION.glob("*.py") if p.stem != "__init__")


def _imported_modules(tree: ast.AST, known: set[str]) -> set[str]:
    """Modules of `phloem.ops.attention` a file imports anywhere (top level or lazily)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith(PREFIX + ".") and name[len(PREFIX) + 1 :] in known:
                found.add(name[len(PREFIX) + 1 :])
    return found


def import_graph(directory: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports ("__init__" for the package itself)."""
    names = {p.stem for p in directory.glob("*.py")}
    return {
        p.stem: _imported_modules(ast.parse(p.read_text()), names) - {p.stem}
        for p in directory.glob("*.py")
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_and_the_interface_imports_no_backend():
    graph = import_graph(ATTENTION)
    assert find_cycle(graph) is None
    assert not graph["interface"] & BACKEND_MODULES, graph["interface"]
    assert not graph["metadata"] and graph["prefix_groups"] == {"metadata"}
    for module in ("tile_plan",):  # Triton-free: unit-tested without Triton
        assert "shared_prefix_triton" not in graph[module]


def test_each_module_imports_first_in_a_fresh_interpreter():
    """Import every module of the package as the first phloem module of an interpreter (an
    import cycle through a top-level import fails this way even where the graph test's lazy
    imports would hide it)."""
    modules = [m for m in _modules() if m not in ("shared_prefix_triton", "decode_graph_plan")]
    try:
        import triton  # noqa: F401

        modules += ["shared_prefix_triton", "decode_graph_plan"]
    except ImportError:
        pass
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    for m in [m for m in sys.modules if m == 'phloem' or m.startswith('phloem.')]:\n"
        "        del sys.modules[m]\n"
        f"    importlib.import_module('{PREFIX}.' + name)\n"
        "print('ok', len(sys.argv))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def probes(tree: ast.AST, in_backend_module: bool) -> list[str]:
    """getattr/hasattr calls on a backend object and inspect.signature calls, as source text.
    A backend object is any expression naming a backend (`backend`, `fallback`, `prefill`), or
    `self` inside the backend modules."""
    words = ("backend", "fallback", "prefill") + (("self",) if in_backend_module else ())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        text = ast.unparse(node.func)
        if text == "inspect.signature" or text == "signature":
            found.append(ast.unparse(node))
        elif text in ("getattr", "hasattr") and node.args:
            target = ast.unparse(node.args[0])
            if any(w in target for w in words):
                found.append(ast.unparse(node))
    return found


def test_probes_are_found():
    tree = ast.parse("getattr(self.backend, 'x', None)\nhasattr(fallback, 'y')\ngetattr(cfg, 'z')")
    assert probes(tree, False) == ["getattr(self.backend, 'x', None)", "hasattr(fallback, 'y')"]
    assert probes(ast.parse("inspect.signature(b.forward)"), False)


def test_no_caller_probes_a_backend():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        in_backends = rel.startswith("ops/attention/")
        tree = ast.parse(path.read_text())
        hits = probes(tree, in_backends)
        if not (in_backends or rel in CALLERS):  # elsewhere: only calls naming a backend
            hits = [h for h in hits if "backend" in h]
        if hits:
            found[rel] = hits
    assert not found


def module_attribute_assignments(tree: ast.AST) -> list[str]:
    """Assignments to an attribute of an imported module (`import a.b as m; m.f = g`,
    `setattr(m, ...)`), as source text."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.split(".")[0] for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            root = t
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in aliases:
                found.append(ast.unparse(t))
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "setattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in aliases
        ):
            found.append(ast.unparse(node))
    return found


def test_module_attribute_assignments_are_found():
    tree = ast.parse("import phloem.layers.attention as a\nimport os\na.write_kv = f\nos.sep = 1")
    assert module_attribute_assignments(tree) == ["a.write_kv", "os.sep"]


@pytest.mark.parametrize("rel", CALLERS + ["ops/attention"])
def test_no_module_attribute_replaced_at_run_time(rel):
    paths = [PACKAGE / rel] if rel.endswith(".py") else sorted((PACKAGE / rel).glob("*.py"))
    found = {p.name: module_attribute_assignments(ast.parse(p.read_text())) for p in paths}
    assert not {k: v for k, v in found.items() if v}


def test_every_backend_implements_the_interface():
    for cls in (ReferenceAttention, SharedPrefixAttention):
        assert issubclass(cls, AttentionBackend) and not cls.__abstractmethods__
    plain = get_attention_backend("reference")
    assert plain.graph_variants() == {"plain": 1} and plain.stats() == {}
    assert not plain.supports_cuda_graphs and plain.needs_block_tables
    assert plain.plan_decode([3], [[0]], [0], 16) == DecodePlan(DecodePath.GRAPH, None)
    with pytest.raises(ValueError, match="CUDA graphs"):
        plain.prepare_replay(None)
    assert not plain.supports_verify_graphs  # it reads each step's metadata at every call
    assert plain.plan_verify([2], [5], [[0, 1]], [4], 4)  # no prefix sharing of its own
    with pytest.raises(ValueError, match="verify CUDA graphs"):
        plain.prepare_verify_replay(None)
    shared = get_attention_backend("shared_prefix")
    assert isinstance(shared, SharedPrefixAttention) and shared.reads_prefix_lens
    assert shared.needs_block_tables == plain.needs_block_tables  # the fallback's
    assert shared.supports_verify_graphs == plain.supports_verify_graphs  # the fallback's
    with pytest.raises(ValueError, match="verify CUDA graphs"):
        shared.prepare_verify_replay(None)  # planned on the fallback, which has none
    with pytest.raises(TypeError):
        AttentionBackend()  # forward is abstract


def test_decode_plan_is_typed_and_reads_as_before():
    plan = DecodePlan(DecodePath.EAGER, None)
    assert plan.path is DecodePath.EAGER and plan == ("eager", None)
    assert [p.value for p in DecodePath] == ["graph", "shared_graph", "eager", "small_graph"]


@pytest.mark.parametrize("head_dim", [16, 96])
def test_auto_on_cuda_uses_the_reference_for_head_dims_flashinfer_cannot_compile(head_dim, caplog):
    # FlashInfer builds 64/128/256 only: asking it for head_dim 16 fails at JIT compile time on
    # the GPU, so "auto" must not pick it (checked without a GPU: nothing touches the device)
    backend = get_attention_backend("auto", device="cuda", head_dim=head_dim, num_heads=4,
                                    num_kv_heads=2)  # fmt: skip
    assert isinstance(backend, ReferenceAttention)
    assert f"head_dim {head_dim}" in caplog.text
