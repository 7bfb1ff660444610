"""Make the lessons' numbers their reading order: rename every file that carries a lesson's number
and rewrite every reference to it, everywhere in the repository.

    python scripts/renumber_lessons.py --dry-run   # print the plan (old -> new), touch nothing
    python scripts/renumber_lessons.py             # rename (git mv) and rewrite; prints what it did
    python scripts/renumber_lessons.py --root DIR --no-git   # a copy that is not a git checkout

ORDER below is the reading path, one lesson slug (lessons/NN-<slug>.md) a line: to insert a lesson,
add its slug where it belongs and run the script. The map old -> new is computed from the files as
they are, so the script is idempotent (on a renumbered tree it is the identity, and a second run
changes nothing). A lesson whose slug ORDER does not list goes to the end, in its old order, and the
script names it.

What carries a lesson's number, and is renamed (two passes through temporary names, so 02 -> 04
never meets the old 04): lessons/NN-<slug>.md, lessons/NN_<name>.py (the lesson's script) and
lessons/figures/NN_<name>.* (its figures). What is rewritten, in every tracked text file: those
file names (paths, links, import names such as "17_collectives:ring_all_reduce"); a lesson's
heading "# NN —"; prose "lesson NN", "lessons NN, MM and KK" ('s kept); the lesson column of
the tables in COLUMNS (exercises, predictions); lessons/README.md's table rows (renumbered and
re-sorted). A range ("lessons 00-19") is not rewritten: it is printed for a hand
edit. Atop each lesson a "you are here" line is written (or replaced): its place, previous, next.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

# The reading path. One page of each is enough to read the next.
ORDER = [
    "overview",  # the three walls: why any of this
    "dense-model",  # the model and the trainer every technique is checked against
    "the-modern-block",  # Llama's pieces: the block every later lesson shards
    "collectives",  # what every parallel method sends, before the first one sends it
    "data-parallel-and-zero",  # the first split: the batch, then the optimizer state
    "tensor-parallel",  # split each matrix
    "sequence-parallel",  # split what TP leaves whole
    "long-context",  # split the sequence inside attention (after SP)
    "pipeline-parallel",  # split the layers; the bubble
    "mixed-precision",  # fewer bytes per number
    "fp8-training",  # fewer still (after mixed precision)
    "activation-recompute",  # trade compute for memory
    "flash-attention",  # attention without the s x s scores (after recompute)
    "fused-kernels",  # read each byte once
    "profiling",  # where one step's time and memory go: measure what 09-13 changed
    "3d-parallelism",  # all the splits at once: the rank grid
    "experts",  # routed experts and their all-to-all (after the block and the grid)
    "communication-compression",  # fewer bytes on the wire (ZeRO++)
    "one-bit-adam",  # fewer bytes for the optimizer's all-reduce
    "checkpoints-and-failures",  # a job that survives a kill
    "when-training-breaks",  # spikes, preemptions, frozen ranks
    "planning-a-run",  # the planner: every lesson's formula priced at scale
    "sizing-a-run",  # parameters, tokens, batch, learning rate (after planning)
    "capstone",  # your run: everything above, graded
]
LESSON = re.compile(r"^(\d\d)-([\w-]+)\.md$")
TEXT = {".md", ".py", ".toml", ".txt", ".sh", ".sbatch", ".cfg", ".yml", ".yaml", ".json", ""}
TEXT |= {".cpp", ".cu", ".cuh", ".h", ".c"}  # csrc/'s "Lesson:" comments
HERE = "> **You are here:**"
SKIP = {
    "scripts/renumber_lessons.py",
    "tests/test_renumber.py",
}  # they quote old numbers on purpose
# Tables whose lesson column is a bare number: {file: a rule capturing it as group 1}
COLUMNS = {
    "lessons/grade.py": r'Exercise\(\s*"(\d\d)"',
    "lessons/predict.py": r'\(\s*"(\d\d)",',
    "lessons/exercises/README.md": r"(?m)^\| `[\w-]+` \| (\d\d) \|",
}


def lessons(root: Path) -> dict:
    """{old number: slug} of lessons/NN-<slug>.md; two lessons sharing a number are refused."""
    found = {}
    for p in sorted((root / "lessons").glob("[0-9][0-9]-*.md")):
        number, slug = LESSON.match(p.name).groups()
        if number in found:
            sys.exit(
                f"renumber_lessons: lessons {number}-{found[number]}.md and {p.name} share a number"
            )
        found[number] = slug
    return found


def plan(found: dict) -> tuple:
    """({old: new}, [slugs ORDER does not know, sent to the end])."""
    known = sorted((ORDER.index(s), old) for old, s in found.items() if s in ORDER)
    unknown = sorted(old for old, s in found.items() if s not in ORDER)
    order = [old for _, old in known] + unknown
    return {old: f"{i:02d}" for i, old in enumerate(order)}, [found[o] for o in unknown]


def carriers(root: Path, found: dict) -> list:
    """Every file that carries a lesson's number: (path relative to root, its number)."""
    paths = [root / "lessons" / f"{n}-{s}.md" for n, s in found.items()]
    for n in found:
        paths += sorted((root / "lessons").glob(f"{n}_*.py"))
        paths += sorted((root / "lessons" / "figures").glob(f"{n}_*"))
    return [(p.relative_to(root), p.name[:2]) for p in paths]


def rename(root: Path, moves: list, git: bool):
    """Two passes (old -> temporary -> new) so that no new name meets an old one."""

    def mv(a, b):
        if git:
            subprocess.run(["git", "mv", str(a), str(b)], cwd=root, check=True)
        else:
            (root / a).rename(root / b)

    temporary = [(a, a.with_name("renumbering-" + a.name), b) for a, b in moves]
    for a, t, _ in temporary:
        mv(a, t)
    for _, t, b in temporary:
        mv(t, b)


def rewriter(found: dict, new: dict, names: dict):
    """A function text -> (text, ranges left for a hand edit) applying every rewrite in one pass
    (one pass: 02 -> 04 is never read again as 04 -> 06)."""
    moved = {old: n for old, n in names.items() if old != n}
    alternatives = "|".join(re.escape(k) for k in sorted(moved, key=len, reverse=True))
    stems = re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])") if moved else None
    number = r"\d\d(?!\d)(?:'s)?"
    prose = re.compile(
        rf"\b([Ll]essons?[\s-])({number}(?:(?:,\s(?:and\s|or\s)?|\sand\s|\sor\s){number})*)"
        r"(\s*[-–]\s*\d\d)?"
    )

    def in_prose(m):
        if m.group(3):  # a range: not a list of lessons once renumbered
            ranges.append(m.group(0))
            return m.group(0)
        body = re.sub(r"\d\d", lambda n: new.get(n.group(0), n.group(0)), m.group(2))
        return m.group(1) + body

    # a link whose text is the lesson's bare number: [09](lessons/09-3d-parallelism.md)
    link = re.compile(r"\[(\d\d)\](?=\((?:[^)\s]*/)?(\d\d)-[\w-]+\.md)")

    def in_link(m):
        same = m.group(1) == m.group(2)
        return f"[{new.get(m.group(1), m.group(1))}]" if same else m.group(0)

    def apply(text):
        ranges.clear()
        text = link.sub(in_link, text)
        if stems:
            text = stems.sub(lambda m: moved[m.group(0)], text)
        return prose.sub(in_prose, text), list(ranges)

    ranges = []
    return apply


def number_column(text: str, new: dict, rule: str) -> str:
    """Rewrite the lesson number a table's rule captures as group 1 (grade.py, predict.py)."""

    def swap(m):
        a, b = m.start(1) - m.start(0), m.end(1) - m.start(0)
        return m.group(0)[:a] + new.get(m.group(1), m.group(1)) + m.group(0)[b:]

    return re.sub(rule, swap, text)


def table_rows(text: str, new: dict) -> str:
    """lessons/README.md: `| NN | [title](NN-slug.md) ...` rows renumbered, each table re-sorted."""
    row = re.compile(r"^\| (\d\d) \| \[")
    lines, out, block = text.split("\n"), [], []
    for line in lines + [""]:
        m = row.match(line)
        if m:
            block.append(f"| {new.get(m.group(1), m.group(1))} |" + line[len(m.group(0)) - 2 :])
            continue
        out += sorted(block, key=lambda r: r[2:4])
        block = []
        out.append(line)
    return "\n".join(out[:-1])


def title(path: Path) -> str:
    """A lesson's short title: its heading after the number, up to a colon."""
    head = path.read_text().split("\n", 1)[0]
    return re.sub(r"^#\s*\d\d\s*[—·-]\s*", "", head).split(":")[0].strip()


def here_lines(root: Path):
    """Write (or replace) the "you are here" line under each lesson's heading."""
    path = sorted((root / "lessons").glob("[0-9][0-9]-*.md"))
    last = path[-1].name[:2]
    for i, p in enumerate(path):
        link = lambda q: f"[{q.name[:2]} {title(q)}]({q.name})"  # noqa: E731
        parts = [f"{HERE} lesson {p.name[:2]} of 00-{last} ([the reading path](README.md))"]
        parts.append(f"previous: {link(path[i - 1])}" if i else "the first")
        parts.append(f"next: {link(path[i + 1])}" if i + 1 < len(path) else "the last")
        line = " · ".join(parts)
        head, _, rest = p.read_text().partition("\n")
        rest = re.sub(rf"^\n?{re.escape(HERE)}[^\n]*\n", "", rest)
        p.write_text(f"{head}\n\n{line}\n{rest}")


def tracked(root: Path, git: bool) -> list:
    if git:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
        files = [root / f for f in out.stdout.splitlines()]
    else:
        files = [p for p in root.rglob("*") if ".git" not in p.parts]
    return [p for p in files if p.is_file() and p.suffix in TEXT]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--dry-run", action="store_true", help="print the plan, touch nothing")
    ap.add_argument("--no-git", action="store_true", help="rename with the file system, not git mv")
    args = ap.parse_args(argv)
    root, git = Path(args.root).resolve(), not args.no_git
    found = lessons(root)
    new, unknown = plan(found)

    # the plan
    for old, slug in sorted(found.items(), key=lambda kv: new[kv[0]]):
        print(f"{old}-{slug} -> {new[old]}" + ("" if old != new[old] else " (unchanged)"))
    if unknown:
        print(f"not in ORDER, sent to the end: {', '.join(unknown)} (add them to ORDER)")
    if args.dry_run:
        return 0

    # 1. rename what carries a number
    moves = [(p, p.with_name(new[n] + p.name[2:])) for p, n in carriers(root, found)]
    names = {p.stem if p.suffix in (".md", ".py") else p.name: q for p, q in moves}
    names = {k: (q.stem if q.suffix in (".md", ".py") else q.name) for k, q in names.items()}
    rename(root, [(a, b) for a, b in moves if a != b], git)

    # 2. rewrite every reference, one pass per file
    apply, left = rewriter(found, new, names), []
    for path in tracked(root, git):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if rel in SKIP:
            continue
        out, ranges = apply(text)
        left += [f"{rel}: {r}" for r in ranges]
        if re.match(r"lessons/\d\d-", rel):
            out = re.sub(
                r"^# (\d\d)(?= [—·])", lambda m: "# " + new.get(m.group(1), m.group(1)), out
            )
        if rel in COLUMNS:
            out = number_column(out, new, COLUMNS[rel])
        if rel == "lessons/README.md":
            out = table_rows(out, new)
        if out != text:
            path.write_text(out)

    # 3. the "you are here" lines
    here_lines(root)
    for line in left:
        print(f"a range, not rewritten (edit by hand): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
