"""The package's layering, checked on the source: every .py under engine/, graphs/ and
cutlass_kernels/ is parsed with ``ast`` (nothing is imported) and its imports are held to the
rules of DESIGN.md "Layout":

(a) no import circle between modules;
(b) nothing in the package imports ``tools`` (scripts) or ``tests``;
(c) graphs/ does not import engine.executor (the graph runner knows no executor);
(d) engine/kv imports nothing from the engine outside engine.kv;
(e) arrows point down: a module imports its own layer or a lower one (``LAYERS``), never a
    higher one; every module is placed in a layer.

An import counts wherever it is written, inside a function too (a lazy import is still a
dependency); only imports under ``if TYPE_CHECKING:`` do not. String imports
(``importlib.import_module``, the CLI's subcommand table) are not seen. Importing ``a.b.c`` does
not count as importing the package ``a.b`` itself (its ``__init__``), as it is already loaded.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOTS = ("engine", "graphs", "cutlass_kernels")
FORBIDDEN = ("tools", "tests")  # rule (b): top-level packages the package never imports

# Rule (e). Module prefix -> layer, highest first. A key names a module and everything under it
# (the longest matching key wins), except "engine" itself, which is engine/__init__.py only.
LAYERS: dict[str, int] = {
    # front ends: the package facade, the CLI and its commands, the Python API, the server
    "engine": 7,  # engine/__init__.py only: its lazy LLM / SamplingParams
    "engine.cli": 7,
    "engine.commands": 7,
    "engine.api": 7,
    "engine.server": 7,
    "engine.core": 7,  # the server's engine core process and its client
    # the in-process core: LLMEngine.step() = schedule -> execute -> update_from_output; and
    # EngineArgs, the user's options, resolved into an EngineConfig through the backend registry
    "engine.engine": 6,
    "engine.args": 6,
    # the stages of a step
    "engine.scheduler": 5,
    "engine.speculative": 4,
    "engine.executor": 5,
    "engine.parallel": 5,  # tensor parallelism: the sharding plan, collectives, the numpy sim
    "engine.input_processor": 5,
    "engine.output_processor": 5,
    # under the scheduler: the block manager; under the executor: graphs, kernels, cuda-python
    "engine.kv": 4,
    "graphs": 4,
    "cutlass_kernels": 4,
    "engine.cuda": 4,
    # the vocabulary every layer above shares
    "engine.model": 3,
    "engine.config": 3,
    "engine.sampling_params": 3,
    "engine.sampling": 3,
    "engine.step": 3,
    "engine.request": 3,
    "engine.outputs": 3,
    "engine.tokenizer": 3,
    "engine.logits_processors": 3,  # per-request logits processors, host side
    "engine.structured": 3,  # structured output: grammars and llguidance matchers
    "engine.tracepoints": 3,  # admission tracepoints (CUTEINFER_ADMIT_TRACE)
    # leaves: import nothing from the package
    "engine.envs": 2,
    "engine.jsonfile": 2,
    "engine.progress": 2,
}
EXACT_ONLY = {"engine"}  # keys that do not extend to their submodules

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (a package module where a name is imported from it)
    file: str  # path relative to the repo
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.source} imports {self.target}"


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return ((isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
            or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping ``if TYPE_CHECKING:`` bodies."""
    out: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.orelse:
                out += _import_nodes(ast.Module(body=[stmt], type_ignores=[]))
        else:
            out += _import_nodes(child)
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str:
    """The longest known module that ``name`` names or lies in; ``name`` itself if external."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in mods:
            return ".".join(parts[:n])
    return name


def _imports(mods: dict[str, Path]) -> list[Import]:
    out: list[Import] = []
    for mod, path in mods.items():
        rel = str(path.relative_to(REPO))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _import_nodes(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule when there is one
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]
            for name in dict.fromkeys(names):
                target = _resolve(name, mods)
                if target != mod:
                    out.append(Import(mod, target, rel, node.lineno))
    return out


MODULES = _modules()
IMPORTS = _imports(MODULES)
INTERNAL = [i for i in IMPORTS if i.target in MODULES]


def _layer(mod: str) -> int | None:
    keys = [k for k in LAYERS
            if mod == k or (k not in EXACT_ONLY and mod.startswith(k + "."))]
    return LAYERS[max(keys, key=len)] if keys else None


def _in(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _report(rule: str, bad: list[Import]) -> str:
    lines = [f"{rule}: {len(bad)} violation(s)"] + [f"  {i.where()}" for i in bad]
    print("\n".join(lines))
    return "\n".join(lines)


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in INTERNAL:
        graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    sccs.append(sorted(scc))
    return sccs


def test_the_source_was_found() -> None:
    assert {"engine.engine", "engine.kv.block_manager", "graphs.runner"} <= set(MODULES)
    assert any(i.source == "engine.scheduler" and i.target == "engine.kv" for i in INTERNAL)


def _shortest_circle(members: set[str]) -> list[Import]:
    """The shortest closed path of imports inside one strongly connected component (BFS)."""
    edges = [i for i in INTERNAL if i.source in members and i.target in members]
    best: list[Import] = []
    for start in sorted(members):
        path: dict[str, list[Import]] = {start: []}  # shortest path from start to each module
        frontier = [start]
        while frontier:
            reached = []
            for i in edges:
                if i.source in frontier and i.target not in path:
                    path[i.target] = path[i.source] + [i]
                    reached.append(i.target)
            frontier = reached
        for i in edges:
            if i.target == start and i.source in path:
                cycle = path[i.source] + [i]
                if not best or len(cycle) < len(best):
                    best = cycle
    return best


def test_no_import_circles() -> None:
    circles = _circles()
    lines = []
    for scc in circles:
        members = set(scc)
        lines.append("circle: " + ", ".join(str(MODULES[m].relative_to(REPO)) for m in scc))
        shortest = _shortest_circle(members)
        lines.append("  shortest: " + " -> ".join([i.source for i in shortest]
                                                  + [shortest[0].source]))
        lines += [f"    {i.where()}" for i in shortest]
        lines.append("  every import inside it:")
        lines += [f"    {i.where()}" for i in INTERNAL
                  if i.source in members and i.target in members]
    print("\n".join(lines))
    assert not circles, "\n".join(lines)


def test_the_package_never_imports_tools_or_tests() -> None:
    bad = [i for i in IMPORTS if i.target.split(".")[0] in FORBIDDEN]
    assert not bad, _report("(b) the package imports tools/ or tests/", bad)


def test_graphs_know_no_executor() -> None:
    bad = [i for i in INTERNAL if _in(i.source, "graphs") and _in(i.target, "engine.executor")]
    assert not bad, _report("(c) graphs/ imports engine.executor", bad)


def test_kv_imports_nothing_else_from_the_engine() -> None:
    bad = [i for i in INTERNAL if _in(i.source, "engine.kv") and _in(i.target, "engine")
           and not _in(i.target, "engine.kv")]
    assert not bad, _report("(d) engine/kv imports from the engine outside engine.kv", bad)


def test_every_module_has_a_layer() -> None:
    missing = sorted(str(MODULES[m].relative_to(REPO)) for m in MODULES if _layer(m) is None)
    assert not missing, f"place these modules in LAYERS ({__file__}): {missing}"


def test_arrows_point_down() -> None:
    bad = [i for i in INTERNAL
           if None not in (_layer(i.source), _layer(i.target))
           and _layer(i.target) > _layer(i.source)]  # type: ignore[operator]
    assert not bad, _report("(e) a lower layer imports a higher one", [
        Import(i.source, f"{i.target} (layer {_layer(i.source)} -> {_layer(i.target)})",
               i.file, i.line) for i in bad])


@pytest.mark.parametrize("source, target, ok", [
    ("engine.scheduler", "engine.kv", True), ("engine.kv.pool", "engine.scheduler", False),
    ("graphs.runner", "engine.cuda.driver", True), ("engine.step", "engine.engine", False),
    ("engine.server.app", "engine.engine", True), ("engine", "engine.api", True)])
def test_the_layer_table_reads_as_written(source: str, target: str, ok: bool) -> None:
    assert (_layer(target) <= _layer(source)) is ok  # type: ignore[operator]
