"""The exercise grader (lessons/grade.py, run as `python lessons/check.py --exercise NAME FILE`) can
pass and fail.

Runs of check.py, as a student runs it: every solution passes every test its exercise names (one
run); every untouched starter fails with its own NotImplementedError (in spawned ranks too: tp-fg's
and flat's are raised in the ranks, so the substitution reached them), and a planted bug in each of
1f1b, cp-merge, ring, flash, router, zero3, flash-backward, balance and peak fails, its line naming
the failing case: two `--quick` runs, exercises whose tests share a spawned world (flat, zero3) in
different runs; the second also grades a 1F1B with an uncapped warm-up, which its one --quick test
must catch.
The predictions (lessons/predict.py): right answers RIGHT, a wrong bubble WRONG, a missing one
unanswered.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "lessons" / "exercises"
SOLUTIONS = {
    "tp-fg": "tp_fg.py",
    "vocab-ce": "vocab_ce.py",
    "1f1b": "one_f_one_b.py",
    "flat": "flat.py",
    "cp-merge": "cp_merge.py",
    "ring": "ring.py",
    "router": "router.py",
    "flash": "flash.py",
    "zero3": "zero3.py",
    "flash-backward": "flash_backward.py",
    "balance": "balance.py",
    "peak": "peak.py",
}
BUGGY_1F1B = """from nanomega.schedules import Op


def one_f_one_b(p, rank, m, v=1):
    warmup = min(p - rank, m)  # one forward too many in flight: the planted bug
    rounds = [[Op("F", i)] for i in range(warmup)]
    for i in range(m - warmup):
        rounds += [[Op("F", warmup + i)], [Op("B", i)]]
    return rounds + [[Op("B", i)] for i in range(m - warmup, m)]
"""

# the most common 1F1B bug: a warm-up of p - rank - 1 forwards even when there are fewer micro-batches
UNCAPPED_1F1B = """from nanomega.schedules import Op


def one_f_one_b(p, rank, m, v=1):
    warmup = p - rank - 1  # not capped at m: the planted bug
    rounds = [[Op("F", i)] for i in range(warmup)]
    for i in range(m - warmup):
        rounds += [[Op("F", warmup + i)], [Op("B", i)]]
    return rounds + [[Op("B", i)] for i in range(max(m - warmup, 0), m)]
"""

# a merge that averages the two parts instead of weighting each by its share of the union's sum
UNWEIGHTED_MERGE = """from nanomega.cp import positions, torch


def merge(acc, new):
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    return (o1 + o2) / 2, torch.logaddexp(l1, l2)  # the planted bug: no re-weighting
"""

# a ring whose all-gather adds the received chunk instead of copying it
BUGGY_RING = """import torch


def ring_all_reduce(ax, x):
    n, r = ax.size, ax.rank
    chunks, buf = list(x.chunk(n)), torch.empty(x.numel() // n, dtype=x.dtype)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        ax.p2p(sends=[(chunks[(r - step) % n].clone(), right)], recvs=[(buf, left)])
        chunks[(r - step - 1) % n] += buf
    for step in range(n - 1):
        ax.p2p(sends=[(chunks[(r + 1 - step) % n].clone(), right)], recvs=[(buf, left)])
        chunks[(r - step) % n] += buf  # the planted bug: a finished chunk is copied, not added
    return x
"""

# an online softmax that rescales the running sum but not the running output
NO_RESCALE_FLASH = """import importlib

import torch

tile_scores = importlib.import_module("12_flash").tile_scores


def flash_forward(q, k, v, block):
    b, a, s, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(b, a, s, dtype=q.dtype)
    for i in range(s // block):
        m = torch.full((b, a, block), float("-inf"), dtype=q.dtype)
        l = torch.zeros(b, a, block, dtype=q.dtype)
        acc = torch.zeros(b, a, block, d, dtype=q.dtype)
        for j in range(i + 1):
            t = tile_scores(q, k, i, j, block)
            m_new = torch.maximum(m, t.amax(-1))
            p = torch.exp(t - m_new[..., None])
            l = l * torch.exp(m - m_new) + p.sum(-1)
            acc = acc + p @ v[..., j * block : (j + 1) * block, :]  # the planted bug: no rescale
            m = m_new
        out[..., i * block : (i + 1) * block, :] = acc / l[..., None]
        lse[..., i * block : (i + 1) * block] = m + torch.log(l)
    return out, lse
"""

# softmax_topk_norm's weights left unnormalized (the two softmax rules mixed up)
UNNORMALIZED_ROUTER = """from nanomega import moe


def route(logits, k, router="mixtral", bias=None, groups=(1, 1), scale=1.0):
    router = moe.rule(router)
    if router == "deepseek_v3":
        return moe.sigmoid_route(logits, k, bias, groups, scale)
    probs = logits.softmax(-1)
    experts = (probs if bias is None else probs + bias).topk(k, dim=-1).indices
    if router == "mixtral":
        return logits.gather(-1, experts).softmax(-1), experts, probs
    return probs.gather(-1, experts), experts, probs  # the planted bug: never renormalized
"""

# a ZeRO-3 gather that ignores prefetches: the next unit is not gathered while this one runs
NO_PREFETCH_ZERO3 = (
    (EX / "solutions" / "zero3.py")
    .read_text()
    .replace(
        "def gather(self, u, wait=True):\n",
        "def gather(self, u, wait=True):\n"
        "    if not wait:  # the planted bug: a prefetch does nothing\n"
        "        return\n",
    )
)

# a FlashAttention backward without D = rowsum(dO O): the softmax's Jacobian loses its row term
NO_D_FLASH_BACKWARD = (
    (EX / "solutions" / "flash_backward.py")
    .read_text()
    .replace("rows = (dout * out).sum(-1)", "rows = 0 * out[..., 0]  # the planted bug: D dropped")
)

# a balance loss whose shares f are counted over the whole batch, not per sequence
BATCH_BALANCE = (
    (EX / "solutions" / "balance.py")
    .read_text()
    .replace(
        "counts = F.one_hot(experts.flatten(1), n_experts).sum(1).float()",
        "counts = F.one_hot(experts.flatten(), n_experts).sum(0).float() / b  # planted",
    )
)
assert "# planted" in BATCH_BALANCE, "the balance solution changed: plant the bug again"

# a peak finder that charges each free to the op running when it happens
FREES_CHARGED_PEAK = """def holds_peak(trace):
    events = trace["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])

    def running(e):
        around = [o for o in ops if o["tid"] == e["tid"] and o["ts"] <= e["ts"] <= o["ts"] + o["dur"]]
        return max(around, key=lambda o: o["ts"])["name"] if around else "(no op)"

    held, now, peak, at_peak = {}, 0, 0, {}
    for e in memory:  # the planted bug: an op's bytes = its allocations - the frees while it runs
        held[running(e)] = held.get(running(e), 0) + e["args"]["Bytes"]
        now += e["args"]["Bytes"]
        if now > peak:
            peak, at_peak = now, dict(held)
    op = max(at_peak, key=at_peak.get)
    return op, at_peak[op], peak
"""


def check(*args):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "lessons" / "check.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    verdicts = dict(re.findall(r"^exercise (\S+): \d+/\d+ tests pass -> (PASS|FAIL)$", out, re.M))
    return proc.returncode, verdicts, out


def pairs(folder, names):
    return [a for name in names for a in ("--exercise", name, str(folder / SOLUTIONS[name]))]


def test_every_solution_passes_its_tests():
    rc, verdicts, out = check(*pairs(EX / "solutions", SOLUTIONS))
    assert verdicts == dict.fromkeys(SOLUTIONS, "PASS") and rc == 0, out
    # every test ran, none skipped (a test two exercises name is printed for each)
    passed = len(re.findall(r"^PASS ", out, re.M))
    assert passed >= 9 + 9 + 12 + 16 + 9 + 5 + 3 + 3 + 5, out


def test_untouched_starters_and_a_planted_bug_fail(tmp_path):
    """One run (the suite's budget): the tp-fg starter fails by its own NotImplementedError, raised
    in spawned ranks (the substitution reached them), and a planted bug in each of 1f1b (a warm-up
    one forward too many), cp-merge, ring, flash, router and zero3 fails, its line naming the case.
    The vocab-ce and 1f1b starters raise the same way in the pytest process itself."""
    planted = {
        "1f1b": BUGGY_1F1B,
        "cp-merge": UNWEIGHTED_MERGE,
        "ring": BUGGY_RING,
        "flash": NO_RESCALE_FLASH,
        "router": UNNORMALIZED_ROUTER,
        "zero3": NO_PREFETCH_ZERO3,
        "flash-backward": NO_D_FLASH_BACKWARD,
        "balance": BATCH_BALANCE,
        "peak": FREES_CHARGED_PEAK,
    }
    for name, text in planted.items():
        (tmp_path / f"planted_{name}.py").write_text(text)
    rc, verdicts, out = check(
        "--quick",
        *pairs(EX, ["tp-fg"]),
        *[
            a
            for name in planted
            for a in ("--exercise", name, str(tmp_path / f"planted_{name}.py"))
        ],
    )
    assert verdicts == dict.fromkeys(["tp-fg", *planted], "FAIL") and rc == 1, out
    assert re.search(
        r"^FAIL .*\(rank \d failed: NotImplementedError: exercise tp-fg:", out, re.M
    ), out
    # each planted bug's line names its case and what differs
    for line in (
        r"tests/test_pp.py::test_op_orders_literal .*(assert|Assertion)",
        r"tests/test_cp_merge.py::.*merged output: \|got - want\|",
        r"tests/test_diagrams.py::.*ring n=4 rank=\d: got \[.*\], want \[",
        r"tests/test_online_softmax.py::.*s=32 block=8: output: \|got - want\| up to",
        r"tests/test_routers.py::.*\('softmax_topk_norm', '\w+', [0-9.e-]+\)",
        r"tests/test_zero.py::.*after block 0: \d+ bytes held, shards \+ root \+ block \d+",
        r"tests/test_online_softmax.py::.*s=32 block=8: d[qk]: \|got - want\| up to",
        r"tests/test_balance_loss.py::.*three sequences routed differently: got \[.*\], want \[",
        r"tests/test_peak.py::.*a free inside another op: got .* want \('C', 120, 180\)",
    ):
        assert re.search("^FAIL " + line, out, re.M), (line, out)


def test_the_other_starters_fail_by_their_own_error(tmp_path):
    """The flat, ring, router, flash, flash-backward, balance and peak starters, untouched: one
    --quick run (their tests lie in six modules; flash and flash-backward name different tests of
    one), each failing test naming its exercise's NotImplementedError; flat's raised in a spawned
    rank. (zero3's starter shares flat's world: checked by hand, not in the suite.)
    The same run grades a 1F1B with an uncapped warm-up (its test lies in test_pp.py, a module none
    of the others' tests is in: the verdicts stay apart, one grader start fewer): `--quick` runs one
    test, which must hold a case with fewer micro-batches than stages, and the failure line names
    the case (p, rank, m) and both orders."""
    names = ["flat", "ring", "router", "flash", "flash-backward", "balance", "peak"]
    buggy = tmp_path / "uncapped_1f1b.py"
    buggy.write_text(UNCAPPED_1F1B)
    rc, verdicts, out = check("--quick", *pairs(EX, names), "--exercise", "1f1b", str(buggy))
    assert verdicts == dict.fromkeys([*names, "1f1b"], "FAIL") and rc == 1, out
    assert re.search(r"^FAIL .*\(rank \d failed: NotImplementedError: exercise flat:", out, re.M)
    for name in names:
        assert re.search(rf"^FAIL .*NotImplementedError: exercise {name}:", out, re.M), out
    assert re.search(
        r"^FAIL tests/test_pp.py::test_op_orders_literal .*1f1b p=4 rank=0 m=2: got \S+, want F0F1B0B1",
        out,
        re.M,
    ), out


def test_a_file_without_the_names_is_one_line(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, _, out = check("--exercise", "tp-fg", str(empty))
    assert rc == 2 and out.strip().splitlines() == [
        f"error: {empty} defines no 'CopyToTensorParallel': exercise tp-fg replaces "
        "nanomega.tp:CopyToTensorParallel; keep the starter's names"
    ], out
    rc, _, out = check("--exercise", "no-such", str(empty))
    assert (
        rc == 2
        and "choose one of tp-fg, vocab-ce, 1f1b, cp-merge, ring, router, flash, zero3, flat" in out
    ), out


def test_predictions_graded_right_and_wrong(tmp_path):
    """One run: the solution's answers with one made wrong (the 1F1B bubble as (p-1)/m, idle over the
    ideal time: the common wrong convention) and one removed: the 26 others measured RIGHT, the wrong one
    WRONG, the missing one unanswered."""
    solution = (EX / "solutions" / "predictions.py").read_text()
    # the untouched starter answers nothing
    assert (EX / "predictions.py").read_text().count(": None,") == 28
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        solution.replace("(p - 1) / (12 + p - 1),", "(p - 1) / 12,").replace(
            '"gpipe-in-flight": m,', '"gpipe-in-flight": None,'
        )
    )
    rc, _, out = check("--predict", str(wrong))
    assert (
        rc == 1 and "predict 1f1b-bubble (lesson 08): yours 0.25, measured 0.2 -> WRONG" in out
    ), out
    assert out.count("-> RIGHT") == 26 and out.count("no prediction yet") == 1, out
    assert "predictions: 26/28 right" in out, out
