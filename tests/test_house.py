"""The house rules, checked on the source (no training, a few seconds): the tree is formatted and
linted (ruff, pyproject.toml's [tool.ruff]); imports point one way (no cycle; model.py imports only
its block's pieces; job/ never imports tools/); no private name is used across modules; a module
holds at most MAX_CODE_LINES lines of code; only dist.py calls torch.distributed's collectives
(every byte is counted by an Axis). Each rule fails on the code it forbids: see the test beside
each."""

import ast
import functools
import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "nanomega"
# Lines of code per module, counted after `ruff format` at 100 columns, without blank lines,
# comments and docstrings (what a reader has to follow, not what explains it). 300: the largest
# modules of the two codebases this one is read beside, formatted and counted the same way, are
# picotron's train.py (298) and model.py (293) and nanoGPT's model.py (265) and train.py (260): a
# module at most as long as theirs reads in one sitting.
MAX_CODE_LINES = 300
# What ruff formats and lints (pyproject.toml's [tool.ruff] says how)
FORMATTED = ["nanomega", "tests", "scripts", "bench", "lessons", ".ci"]
# torch.distributed calls that are not collectives (set-up, the store, error types) are allowed
# outside dist.py
NOT_COLLECTIVES = {
    "is_initialized",
    "get_rank",
    "get_world_size",
    "DistError",
    "distributed_c10d",
    "elastic",
    "destroy_process_group",
}


@functools.cache  # the tree is read once per session: graph() asks for it once per module
def modules():
    return {
        ".".join(p.relative_to(PKG.parent).with_suffix("").parts): p
        for p in sorted(PKG.rglob("*.py"))
    }


def imports_of(name, path):
    """The nanomega modules `name` imports (anywhere in the file), as module names."""
    tree, found, mods = ast.parse(path.read_text()), set(), modules()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nanomega")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            if not base.startswith("nanomega"):
                continue
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return {m for m in found if m in mods and m != name and not m.endswith("__init__")} - {
        "nanomega"
    }


@functools.cache  # three tests walk the one import graph
def graph():
    return {name: frozenset(imports_of(name, path)) for name, path in modules().items()}


def cycles(g):
    """Every module that lies on an import cycle (Tarjan's strongly connected components of size >
    1)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert cycles(graph()) == []
    # the check can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_down():
    g = graph()
    assert g["nanomega.model"] == {
        "nanomega.gpt_config",
        "nanomega.initialization",
        "nanomega.mla",
        "nanomega.modern",
        "nanomega.moe",
        "nanomega.mtp",
        "nanomega.seams",
    }, (
        "model.py is the reference: it imports only its block's pieces, its op table, its shape "
        "(gpt_config.py) and its values (initialization.py)"
    )
    assert g["nanomega.gpt_config"] == {"nanomega.modern"}, (
        "gpt_config.py (the shape) imports only modern.py's MLP width rule"
    )
    assert g["nanomega.initialization"] == set(), (
        "initialization.py (values by parameter name) imports nothing of ours"
    )
    assert g["nanomega.seams"] == set(), "seams.py (the op table, Linear) imports nothing of ours"
    assert g["nanomega.modern"] == {"nanomega.seams"}, (
        "modern.py (RoPE, RMSNorm, SwiGLU) imports only the op table"
    )
    assert g["nanomega.moe"] == {"nanomega.modern", "nanomega.ep"} and g["nanomega.ep"] == set(), (
        "the MoE block's pieces: experts (modern.py) and their all-to-all (ep.py: it receives Axis objects)"
    )
    assert g["nanomega.mla"] == {"nanomega.modern", "nanomega.seams"}, (
        "latent attention (mla.py) is a block piece: RMSNorm (modern.py) and the op table"
    )
    assert g["nanomega.mtp"] == {"nanomega.seams"}, (
        "multi-token prediction (mtp.py) is a model piece: model.py hands it its blocks and norms"
    )
    assert g["nanomega.extension"] == set() and g["nanomega.cpu_adam"] == {"nanomega.extension"}, (
        "the C++ loader stands alone: the engine's host Adam (cpu_adam.py) reaches it without the model"
    )
    for name, deps in g.items():
        if name.startswith("nanomega.job."):
            assert not {d for d in deps if d.startswith("nanomega.tools.")}, (
                f"{name} imports tools/: {deps}"
            )
        # a concept imports concepts only; the composition and the loop (compose.py, train.py) read
        # the Config (job/), and train.py calls tools/ (the preflight, the corpus)
        if name.count(".") == 1 and name not in ("nanomega.train", "nanomega.compose"):
            assert not {d for d in deps if d.count(".") > 1}, (
                f"{name} imports job/ or tools/: {deps}"
            )


def private_uses(tree):
    """`module._name` reads and `from nanomega... import _name`: private names reached from another
    module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("nanomega")
        ):
            found += [
                a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in OUR_MODULES
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return sorted(found)


# and the aliases in use
OUR_MODULES = {p.stem for p in PKG.rglob("*.py")} | {"flags", "F", "P", "C"}


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_private_name_across_modules(name):
    assert private_uses(ast.parse(modules()[name].read_text())) == []


def test_private_check_can_fail():
    code = "from nanomega import tp\ntp._rule('x')\nfrom nanomega.data import _CUT\nfrom .flat import _x\nself._y"
    assert private_uses(ast.parse(code)) == ["_CUT", "_x", "tp._rule"]


def docstring_rows(tree):
    """The line numbers of the module's, classes' and functions' docstrings."""
    rows = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    rows |= set(range(first.lineno, first.end_lineno + 1))
    return rows


def code_lines(text):
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    lines, docs = text.splitlines(), docstring_rows(ast.parse(text))
    comments = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip()
    }
    return sum(1 for i, row in enumerate(lines, 1) if row.strip() and i not in comments | docs)


@pytest.mark.parametrize("name", sorted(modules()))
def test_a_module_reads_in_one_sitting(name):
    n = code_lines(modules()[name].read_text())
    assert n <= MAX_CODE_LINES, f"{name}: {n} lines of code (> {MAX_CODE_LINES}): two concepts?"


def test_code_lines_count_only_code():
    text = '"""Doc\n\nmore."""\n\n# a comment\nx = 1  # kept\n\n\ndef f():\n    """Doc."""\n    return x\n'
    assert code_lines(text) == 3  # x = 1, def f(), return x


def ruff(*args):
    """ruff (the test extra installs it) on FORMATTED, from the checkout's root: its exit status and
    output."""
    exe = shutil.which("ruff")
    assert exe, "ruff is not installed: pip install -e '.[test]' (the test extra brings it)"
    done = subprocess.run([exe, *args, *FORMATTED], cwd=ROOT, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def test_the_tree_is_formatted():
    status, output = ruff("format", "--check")
    assert status == 0, f"run `ruff format` (pyproject.toml's [tool.ruff]):\n{output}"


def test_the_tree_passes_the_linter():
    status, output = ruff("check")
    assert status == 0, f"run `ruff check` and fix what it names:\n{output}"


def collective_calls(text):
    """torch.distributed functions called outside dist.py, other than set-up and the store."""
    aliases = set(re.findall(r"import torch\.distributed as (\w+)", text)) | {"torch.distributed"}
    calls = set()
    for a in aliases:
        calls |= set(re.findall(rf"(?<![\w.]){re.escape(a)}\.(\w+)\(", text))
    return sorted(calls - NOT_COLLECTIVES)


@pytest.mark.parametrize("name", sorted(set(modules()) - {"nanomega.dist"}))
def test_every_collective_goes_through_axis(name):
    assert collective_calls(modules()[name].read_text()) == []


def test_collective_check_can_fail():
    assert collective_calls(
        "import torch.distributed as tdist\ntdist.all_reduce(t)\ntdist.get_rank()"
    ) == ["all_reduce"]


def test_console_scripts_resolve():
    """Every console script in pyproject names a callable that exists (a moved module would break
    `pip install`)."""
    import importlib

    table = (
        (PKG.parent / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    )
    # tomllib is Python >= 3.11 only
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', table, re.M))
    assert scripts
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func, None)), f"{name} = {target}"


def engine_reaches(g, banned=("nanomega.ep", "nanomega.pp", "nanomega.model")):
    """The banned modules the ZeRO engine reaches through any chain of imports, as "via -> module":
    it knows replica groups (zero_rules.Replicas), not the techniques that build them, nor the
    model."""
    found, todo, seen = set(), [(m, m) for m in ENGINE], set()
    while todo:
        via, m = todo.pop()
        for d in g.get(m, ()):
            if d in banned:
                found.add(f"{via} -> {d}")
            elif d not in seen:
                seen.add(d)
                todo.append((via, d))
    return sorted(found)


ENGINE = (
    "nanomega.zero_rules",
    "nanomega.zero",
    "nanomega.zero_buckets",
    "nanomega.zero3",
    "nanomega.ddp",
    "nanomega.offload",
)


def test_engine_reaches_neither_ep_nor_pp_nor_the_model():
    assert engine_reaches(graph()) == []
    # the check can fail: directly, and through another module
    fake = {"nanomega.zero": {"nanomega.ep", "nanomega.clip"}, "nanomega.clip": {"nanomega.pp"}}
    assert engine_reaches(fake) == ["nanomega.zero -> nanomega.ep", "nanomega.zero -> nanomega.pp"]
