"""The house's measurements, printed as JSON: what tests/test_house.py rules on and what a refactor
reports.

    python scripts/house_stats.py [root]        # root: a checkout (default: this one)

Per package (nanomega/): the share of non-blank lines longer than 100 characters; module docstring
lines (sum, median, mean width); functions of 20+ lines with no blank line inside, and the share of
blank lines inside them; code lines (not blank, not a comment, not a docstring) per module, the
largest; ZeroEngine.__init__'s parameters; the longest chain of our imports from the engine's
module; the DP -> ZeRO-1 -> ZeRO-3 reading path in code lines. Counted on the source as it is (CI
checks it is formatted: `ruff format --check`).
"""

import ast
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_house import code_lines  # noqa: E402  (one home: the rule's own count)


def module_name(pkg, path):
    return ".".join(path.relative_to(pkg.parent).with_suffix("").parts)


def imports(pkg):
    """{module: the nanomega modules it imports}, as tests/test_house.py reads them."""
    mods = {module_name(pkg, p): p for p in sorted(pkg.rglob("*.py"))}
    graph = {}
    for name, path in mods.items():
        tree, found = ast.parse(path.read_text()), set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("nanomega")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {m for m in found if m in mods and m != name and not m.endswith("__init__")}
    return graph


def depth(graph, start, seen=()):
    """The longest chain of imports from `start` (0: imports nothing of ours)."""
    deps = [d for d in graph.get(start, ()) if d not in seen]
    return max((1 + depth(graph, d, (*seen, start)) for d in deps), default=0)


def measure(root):
    pkg = Path(root) / "nanomega"
    files = sorted(pkg.rglob("*.py"))
    nonblank = long = 0
    doc_lines, doc_widths, long_fns, blank_in_long, lines_in_long = [], [], [], 0, 0
    code = {}
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        nonblank += sum(1 for line in lines if line.strip())
        long += sum(1 for line in lines if len(line) > 100)
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False)
        if doc is not None and path.name != "__init__.py":
            first = tree.body[0]
            doc_lines.append(first.end_lineno - first.lineno + 1)
            doc_widths += [len(row) for row in lines[first.lineno - 1 : first.end_lineno]]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = lines[node.lineno - 1 : node.end_lineno]
                if len(span) >= 20:
                    blanks = sum(1 for row in span if not row.strip())
                    long_fns.append(blanks)
                    blank_in_long += blanks
                    lines_in_long += len(span)
        code[module_name(pkg, path)] = code_lines(text)
    graph = imports(pkg)
    engine = ast.parse((pkg / "zero.py").read_text())
    init = next(
        n
        for c in ast.walk(engine)
        if isinstance(c, ast.ClassDef) and c.name == "ZeroEngine"
        for n in c.body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    a = init.args
    n_params = len(a.args) + len(a.kwonlyargs) - 1  # without self
    path = [
        m
        for m in (
            "nanomega.ddp",
            "nanomega.zero_buckets",
            "nanomega.zero_rules",
            "nanomega.zero",
            "nanomega.zero3",
        )
        if m in code
    ]
    biggest = sorted(code.items(), key=lambda kv: -kv[1])[:5]
    return {
        "modules": len(files),
        "share_of_lines_over_100": round(long / nonblank, 4),
        "module_docstring_lines_sum": sum(doc_lines),
        "module_docstring_lines_median": statistics.median(doc_lines),
        "module_docstring_mean_width": round(statistics.mean(doc_widths), 1),
        "functions_20_plus_lines": len(long_fns),
        "of_which_without_a_blank_line": sum(1 for b in long_fns if b == 0),
        "blank_share_inside_them": round(blank_in_long / max(1, lines_in_long), 4),
        "code_lines_total": sum(code.values()),
        "code_lines_largest": dict(biggest),
        "zero_engine_init_parameters": n_params,
        "engine_import_depth": depth(graph, "nanomega.zero"),
        "engine_imports_ep_or_pp": sorted(
            m for m in ("nanomega.ep", "nanomega.pp") if m in reachable(graph, "nanomega.zero")
        ),
        "dp_zero1_zero3_reading_path_code_lines": {m: code[m] for m in path},
    }


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


if __name__ == "__main__":
    print(
        json.dumps(
            measure(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent), indent=1
        )
    )
