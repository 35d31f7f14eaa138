"""The layering of docs/reference/architecture.md, checked on every import statement of the package code
(module level and inside functions): schemas -> core (pipeline) -> libraries (libs: generation
engines, datasets, reward functions) -> roles (producers, consumers.reward, consumers.trainer,
consumers.eval, consumers.tracking) -> application (rlstream) -> dev tools (rlstream.dev). Nothing
imports upward (the command line alone offers the dev tools' commands), roles never import each
other, only the Kafka wrapper touches confluent-kafka, nobody edits sys.path, and no modules import
each other in a circle."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = {"schemas", "pipeline"}
LIBS = CORE | {"libs"}
ROLES = ("producers", "consumers.reward", "consumers.trainer", "consumers.eval", "consumers.tracking")
APP = LIBS | set(ROLES) | {"rlstream"}
LAYERS = {  # package -> our packages it may import
    "schemas": {"schemas"},
    "pipeline": CORE,
    "libs": LIBS,
    **{role: LIBS | {role} for role in ROLES},
    "consumers": set(),  # consumers/__init__.py: a namespace only
    "rlstream": APP,
    "rlstream.dev": APP | {"rlstream.dev"},
}
ENTRY_POINTS = {"rlstream/cli.py": {"rlstream.dev"}}
"""The command line offers the dev tools' commands (``rlstream chaos``, ``rlstream bench``)."""
OURS = ("schemas", "pipeline", "libs", "producers", "consumers", "rlstream", "bench", "tests")
KAFKA_WRAPPER = {
    "pipeline/kafka/__init__.py",
    "pipeline/kafka/common.py",
    "pipeline/kafka/producer.py",
    "pipeline/kafka/consumer.py",
    "pipeline/admin.py",
}
RAW_BASELINES = {"rlstream/dev/bench/raw_kafka.py", "rlstream/dev/bench/transport.py"}
"""Benchmarks whose point is to measure raw confluent-kafka next to rlstream's wrapper."""


def package_of(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    if parts[0] == "consumers":
        return "consumers" if parts[1] == "__init__" else ".".join(parts[:2])
    if parts[:2] == ("rlstream", "dev"):
        return "rlstream.dev"
    return parts[0]


def modules() -> list[Path]:
    out = []
    for top in ("schemas", "pipeline", "libs", "producers", "consumers", "rlstream"):
        out += sorted((REPO / top).rglob("*.py"))
    return out


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def owner(module: str) -> str | None:
    """Which of our packages ``module`` belongs to (None: a third-party or stdlib module)."""
    if module.split(".")[0] not in OURS:
        return None
    if module.startswith("consumers."):
        return ".".join(module.split(".")[:2])
    if module == "rlstream.dev" or module.startswith("rlstream.dev."):
        return "rlstream.dev"
    return module.split(".")[0]


def test_every_import_reads_bottom_up():
    bad = []
    for path in modules():
        rel = str(path.relative_to(REPO))
        allowed = LAYERS[package_of(rel)] | ENTRY_POINTS.get(rel, set())
        for line, mod in imports(path):
            pkg = owner(mod)
            if pkg is not None and pkg not in allowed:
                bad.append(f"{rel}:{line} imports {mod} ({package_of(rel)} may import {sorted(allowed)})")
    assert not bad, "\n".join(bad)


def test_every_package_has_a_layer():
    """A new top-level package or role must be placed in the table, not slip past it."""
    assert {package_of(str(p.relative_to(REPO))) for p in modules()} <= set(LAYERS)


def test_only_the_kafka_wrapper_uses_the_raw_client():
    bad = []
    for path in modules():
        rel = str(path.relative_to(REPO))
        if rel in KAFKA_WRAPPER | RAW_BASELINES:
            continue
        bad += [f"{rel}:{line} imports {mod}" for line, mod in imports(path) if mod.split(".")[0] == "confluent_kafka"]
        tree = ast.parse(path.read_text())
        bad += [
            f"{rel}:{n.lineno} reaches into a wrapper's private client (.{n.attr})"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("_client", "_c") and not _is_self(n.value)
        ]
    assert not bad, "\n".join(bad)


TXN_CALLS = {
    "init_transactions",
    "begin_transaction",
    "send_offsets_to_transaction",
    "commit_transaction",
    "abort_transaction",
}


def test_only_the_kafka_core_runs_the_transaction_protocol():
    """Roles say what to produce; ``pipeline.kafka.ExactlyOnceLoop`` begins, sends offsets, commits
    and aborts. No module outside ``pipeline/kafka/`` (roles included) calls a transaction method."""
    bad = []
    for path in modules():
        rel = str(path.relative_to(REPO))
        if rel.startswith("pipeline/kafka/"):
            continue
        tree = ast.parse(path.read_text())
        bad += [
            f"{rel}:{n.lineno} calls .{n.func.attr}()"
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in TXN_CALLS
        ]
    assert not bad, "\n".join(bad)


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def test_nobody_edits_sys_path():
    bad = []
    for path in modules():
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Attribute)
                and n.attr == "path"
                and isinstance(n.value, ast.Name)
                and n.value.id == "sys"
            ):
                bad.append(f"{path.relative_to(REPO)}:{n.lineno}")
    assert not bad, "sys.path used in: " + ", ".join(bad)


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [("rlstream.cli", ("torch", "transformers", "vllm", "deepspeed")), ("pipeline.kafka", ("torch", "transformers"))],
)
def test_light_modules_import_no_heavy_library(module, forbidden):
    """``rlstream --help`` and the Kafka paths stay fast: plug-ins are imported lazily."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imported {out.stdout.strip()}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (module level and inside functions). ``from a.b import
    c`` counts as an import of ``a.b.c`` when that is a module, else of ``a.b``."""
    names = {_module_name(p) for p in modules()}
    graph: dict[str, set[str]] = {}
    for path in modules():
        src = _module_name(path)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                targets |= (subs & names) or {node.module}
        graph[src] = {t for t in targets if t in names and t != src}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_circle_closed_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circles():
    """No circle of imports among the package's modules, counting imports inside functions (a
    circle closed by a function-level import is still one module needing the other both ways)."""
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)
