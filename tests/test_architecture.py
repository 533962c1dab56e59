"""The house: lipcheck's imports flow one way (no module reaches, through any chain of imports, back to itself, and
none imports a layer above its own), an installed package needs nothing from the source checkout, and no file or
function is too long to read."""
import ast
from pathlib import Path

import lipcheck

PKG = Path(lipcheck.__file__).resolve().parent


def modules() -> dict:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = ("lipcheck",) + f.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def import_graph() -> dict:
    """module -> the lipcheck modules it imports (at top level or inside functions: a lazy import is still a
    dependency). Importing a package's own submodule from the package (its __init__) is not an edge back."""
    mods = modules()
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                if t in mods and t != m and not m.startswith(t + "."):
                    edges[m].add(t)
    return edges


def cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_flow_one_way():
    edges = import_graph()
    assert "lipcheck.bounds.spectral" in edges["lipcheck.bounds.lipschitz"]  # the graph is read, not empty
    assert cycles(edges) == []


def test_the_package_reads_nothing_from_the_checkout():
    """No module loads experiments/ or other files by path from outside the package: the CLI works from a wheel."""
    for f in PKG.rglob("*.py"):
        text = f.read_text()
        assert "spec_from_file_location" not in text, f
        assert '"experiments"' not in text and "'experiments'" not in text, f


# The layers of docs/architecture.md, bottom to top: a module may import its own layer and those below it only.
LAYERS = [
    {"gaussian", "rounding", "symbolic", "threads", "files"},
    {"mixers"},
    {"models"},
    {"bounds", "probe", "wellposed", "bench", "bench_process", "bench_stats", "bench_results", "train", "data",
     "checkpoint", "certification", "shard"},
    {"verdicts"},
    {"report", "reports"},
    {"commands"},
    {"cli"},
]


def layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package's __init__: the public API, which may reach anything lazily
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), None)


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "lipcheck" and layer(m) is None] == []


def test_the_layer_rule_sees_the_graph():
    """The rule is read from real edges: models import mixers (a layer below), and the reverse would be flagged."""
    edges = import_graph()
    assert "lipcheck.mixers.ssog" in edges["lipcheck.models.vit"]
    assert layer("lipcheck.mixers.ssog") < layer("lipcheck.models.vit") < layer("lipcheck.bounds.spectral")
    assert layer("lipcheck.reports.certify") < layer("lipcheck.commands.certify") < layer("lipcheck.cli")


def test_no_module_imports_a_layer_above_it():
    up = sorted((m, t) for m, ts in import_graph().items() for t in ts
                if layer(m) is not None and layer(t) is not None and layer(t) > layer(m))
    assert up == []


def test_the_house_is_small_enough_to_read():
    """No file in lipcheck/ over 600 lines, no function over 100, no experiment script over 200 (docs/architecture.md)."""
    big_files = [(f.name, n) for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > 600]
    long_functions = [(f.relative_to(PKG).as_posix(), node.name, node.end_lineno - node.lineno + 1)
                      for f in PKG.rglob("*.py") for node in ast.walk(ast.parse(f.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.end_lineno - node.lineno + 1 > 100]
    scripts = [(f.name, n) for f in (PKG.parent / "experiments").glob("*.py")
               if (n := len(f.read_text().splitlines())) > 200] if (PKG.parent / "experiments").is_dir() else []
    assert (big_files, long_functions, scripts) == ([], [], [])
