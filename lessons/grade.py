"""The exercise grader behind `python lessons/check.py --exercise NAME FILE`: your function, our
tests.

Idea: a "re-implement this function" exercise names the functions of nanomega it replaces (its
targets) and the existing tests that exercise them. The grader runs those tests in a fresh `python
-m pytest` with your file substituted for ours, and prints PASS or FAIL per test: your version
passes or fails the SAME tests as ours.

How the substitution reaches every process. The tests of distributed code run in local worlds
(nanomega.worlds.launch: each rank is forked from a forkserver, a new interpreter that imported
nanomega once), and some run torchrun subprocesses, so patching the pytest process alone would grade
our code in the ranks.
Instead the grader puts lessons/exercises/hook/ first on PYTHONPATH and names the substitution in
$NANOMEGA_EXERCISE. Python imports `sitecustomize` at the start of EVERY interpreter, the forkserver
(whose forked ranks inherit its modules) and torchrun's workers included (they inherit the
environment), and hook/sitecustomize.py calls substitute_from_env() below before any test code runs.
It imports the target module, swaps the attribute, and rebinds every reference to the old object
already held by a loaded nanomega module (a `from x import f`, or a table such as
schedules.SCHEDULES); modules imported later find the new object in its home module. If your file
cannot be loaded, that interpreter prints why and exits with status 3: never a silent fallback to
our code.
The verdicts come back through hook/nanomega_grade_report.py, a pytest plugin that writes each
test's outcome and what it raised (a local rank's nanomega.worlds.RankFailed: its rank, type and
message) as JSON lines; nothing is read from pytest's printed or XML wording, which changes between
releases.

The "predict the number" exercises are in lessons/predict.py: a number you write down, then the
experiment that measures it, printed next to it.
Lesson: lessons/exercises/README.md
"""

import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LESSONS = Path(__file__).resolve().parent
ROOT = LESSONS.parent
HOOK = LESSONS / "exercises" / "hook"
ENV = "NANOMEGA_EXERCISE"
REPORT = "NANOMEGA_GRADE_REPORT"  # where the grader's pytest plugin writes its lines


@dataclasses.dataclass(frozen=True)
class Exercise:
    lesson: str
    # "module:attribute" or "module:Class.method": what your file's same-named object replaces (a
    # lesson script is the module of its file name, "03_collectives": lessons/ is on the path)
    targets: tuple
    tests: tuple  # pytest node ids (a prefix selects every parametrization)
    # one node id of them: a first try (--quick), and test_exercises' check that a starter fails
    quick: str
    what: str


EXERCISES = {
    "tp-fg": Exercise(
        "05",
        ("nanomega.tp:CopyToTensorParallel", "nanomega.tp:ReduceFromTensorParallel"),
        (
            "tests/test_tp.py::test_layers_match_dense",
            "tests/test_tp.py::test_gpt_matches_dense_after_adamw_steps",
        ),
        "tests/test_tp.py::test_layers_match_dense[tp-2]",
        "Megatron's f and g: the autograd pair around a column- and a row-parallel linear",
    ),
    "vocab-ce": Exercise(
        "05",
        ("nanomega.tp_loss:vocab_parallel_cross_entropy",),
        (
            "tests/test_tp.py::test_layers_match_dense",
            "tests/test_tp.py::test_gpt_matches_dense_after_adamw_steps",
        ),
        "tests/test_tp.py::test_layers_match_dense[tp-2]",
        "the cross-entropy of vocabulary-split logits, no rank holding all of them",
    ),
    "1f1b": Exercise(
        "08",
        ("nanomega.schedules:one_f_one_b",),
        (
            "tests/test_pp.py::test_op_orders_literal",
            "tests/test_pp.py::test_op_orders_many",
            "tests/test_pp.py::test_unit_clock_bubble_equals_formula",
        ),
        "tests/test_pp.py::test_op_orders_literal",
        "the 1F1B schedule: warm-up, steady state, cool-down",
    ),
    "cp-merge": Exercise(
        "07",
        ("nanomega.cp:merge", "nanomega.cp:positions"),
        ("tests/test_cp_merge.py",),
        "tests/test_cp_merge.py::test_merge_equals_softmax_over_both_key_sets[(0, 6, 12)]",
        "context parallelism's online-softmax merge and its head/tail chunks",
    ),
    "ring": Exercise(
        "03",
        ("03_collectives:ring_all_reduce",),
        (
            "tests/test_diagrams.py::test_ring_all_reduce_is_the_sum_on_every_rank",
            "tests/test_diagrams.py::test_ring_sends_2n_minus_2_chunks_and_reduces_one_per_rank",
        ),
        "tests/test_diagrams.py::test_ring_all_reduce_is_the_sum_on_every_rank[4]",
        "the ring all-reduce from point-to-point sends: reduce-scatter, then all-gather",
    ),
    "router": Exercise(
        "16",
        ("nanomega.moe:route",),
        (
            "tests/test_routers.py::test_each_router_is_its_models_and_no_other",
            "tests/test_routers.py::test_deepseek_v3_chooses_within_topk_group_groups",
            "tests/test_routers.py::test_old_names_keep_their_rule_and_resume_under_the_new_one",
        ),
        "tests/test_routers.py::test_each_router_is_its_models_and_no_other",
        "the MoE router: which k experts a token goes to, and with what weights",
    ),
    "flash": Exercise(
        "12",
        ("12_flash:flash_forward",),
        ("tests/test_online_softmax.py",),
        "tests/test_online_softmax.py::test_tiled_forward_equals_softmax_attention[32-8]",
        "FlashAttention's forward: the online softmax over tiles of scores",
    ),
    "zero3": Exercise(
        "04",
        ("nanomega.zero3:ShardedParameters.gather", "nanomega.zero3:ShardedParameters.release"),
        (
            "tests/test_zero.py::test_two_ranks_equal_single_process_bitwise[gpt-3]",
            "tests/test_zero.py::test_two_ranks_equal_single_process_bitwise[toy-3]",
            "tests/test_zero.py::test_zero3_moves_1_5x_dp_bytes",
            "tests/test_zero.py::test_bf16_zero3_is_16_bytes_over_n",
            "tests/test_zero.py::test_zero3_gathers_one_unit_ahead",
        ),
        "tests/test_zero.py::test_zero3_gathers_one_unit_ahead",
        "ZeRO-3's gather and free: a unit's parameters exist only while it runs",
    ),
    "flat": Exercise(
        "04",
        (
            "nanomega.flat:FlatGroup.flatten",
            "nanomega.flat:FlatGroup.views",
            "nanomega.flat:FlatGroup.pieces",
            "nanomega.flat:split_by_size",
        ),
        (
            "tests/test_zero.py::test_two_ranks_equal_single_process_bitwise",
            "tests/test_zero.py::test_fp32_gradients_accumulate_in_the_buffer",
        ),
        "tests/test_zero.py::test_two_ranks_equal_single_process_bitwise[gpt-1]",
        "ZeRO's flat buffers: lay parameters end to end, view them back, find this rank's pieces",
    ),
    "flash-backward": Exercise(
        "12",
        ("12_flash:flash_backward",),
        ("tests/test_online_softmax.py::test_tiled_backward_equals_softmax_attention_gradients",),
        "tests/test_online_softmax.py::test_tiled_backward_equals_softmax_attention_gradients[32-8]",
        "FlashAttention-2's backward: P recomputed tile by tile from the saved log-sum-exp",
    ),
    "balance": Exercise(
        "16",
        ("nanomega.moe:balance_loss",),
        (
            "tests/test_balance_loss.py",
            "tests/test_hf_deepseek.py::test_balance_loss_is_deepseek_v3_sequence_wise_loss",
            "tests/test_routers.py::test_balance_coefficient_is_converted_to_and_from_transformers",
        ),
        "tests/test_balance_loss.py::test_balance_loss_is_switchs_per_sequence"
        "[three sequences routed differently]",
        "the MoE balance loss: Switch/GShard's per sequence (DeepSeek-V3's sequence-wise loss)",
    ),
    "peak": Exercise(
        "14",
        ("14_profiling:holds_peak",),
        ("tests/test_peak.py",),
        "tests/test_peak.py::test_holds_peak_of_a_built_trace[a free inside another op]",
        "find the op that holds the memory peak: a profiler trace's allocations and frees replayed",
    ),
}


def exercise(name):
    if name not in EXERCISES:
        raise ValueError(f"--exercise {name!r} is unknown; choose one of {', '.join(EXERCISES)}")
    return EXERCISES[name]


def load_file(path, module_name):
    """The student's file as a module (by path: it need not be on sys.path)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"exercise file {path} does not exist; pass the path of your .py file")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _rebind(old, new):
    """Every loaded nanomega module's global, or module-level dict value, that is `old` now points
    at `new`."""
    for name, module in list(sys.modules.items()):
        if not (name == "nanomega" or name.startswith("nanomega.")):
            continue
        for key, value in list(vars(module).items()):
            if value is old:
                setattr(module, key, new)
            elif isinstance(value, dict):
                for k, v in list(value.items()):
                    if v is old:
                        value[k] = new


def substitute(name, path):
    """Replace, in this process, each target of exercise `name` by the same-named object of the file
    at path."""
    student = load_file(path, f"student_{name.replace('-', '_')}")
    for target in exercise(name).targets:
        module_name, qualname = target.split(":")
        *owner_path, attr = qualname.split(".")
        owner = functools.reduce(getattr, owner_path, importlib.import_module(module_name))
        if not hasattr(student, attr):
            raise ValueError(f"{path} defines no {attr!r}: exercise {name} replaces {target}")
        old, new = getattr(owner, attr), getattr(student, attr)
        setattr(owner, attr, new)
        _rebind(old, new)


def substitute_from_env():
    """Called by lessons/exercises/hook/sitecustomize.py in every interpreter the grader starts."""
    for name, path in json.loads(os.environ[ENV]):
        substitute(name, path)


def check_file(name, path):
    """Load the student's file here first: a syntax error or a missing name is one line, before any
    test runs."""
    student = load_file(path, f"check_{name.replace('-', '_')}")
    for target in exercise(name).targets:
        attr = target.rsplit(".", 1)[-1].split(":")[-1]
        if not hasattr(student, attr):
            raise ValueError(
                f"{path} defines no {attr!r}: exercise {name} replaces {target}; keep the starter's names"
            )


def grade(pairs, quiet=False, first_failure=False, quick=False):
    """Run the tests of every (exercise, file) pair in one pytest with all substitutions made; print
    PASS or FAIL per test and per exercise. Returns {exercise: passed}. Several pairs share one run
    (and one spawned world per test module): for solutions that all pass; a failure there cannot be
    told apart, so grade a new attempt alone. first_failure: stop at the first failing test (pytest
    -x; a world that fails is otherwise spawned again for each test that uses it). quick: only each
    exercise's `quick` test. Exercises whose tests lie in different test modules can share a run
    even when failing: each starter's message names its exercise."""
    pairs = [(name, str(Path(path).resolve())) for name, path in pairs]
    tests = []
    for name, path in pairs:
        check_file(name, path)
        mine = (exercise(name).quick,) if quick else exercise(name).tests
        tests += [t for t in mine if t not in tests]
    env = dict(os.environ, **{ENV: json.dumps(pairs)})
    # lessons/ too: an exercise may replace a lesson script's function ("03_collectives:...")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HOOK), str(ROOT), str(LESSONS)] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        # written by hook/nanomega_grade_report.py, one line per test phase
        report = Path(tmp) / "report.jsonl"
        env[REPORT] = str(report)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "nanomega_grade_report",
                *(["-x"] if first_failure else []),
                *tests,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        results = read_report(report) if report.exists() else {}
    if not results:
        print(
            f"grader: no test ran (pytest exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    verdict = {}
    for name, _ in pairs:
        wanted = (exercise(name).quick,) if quick else exercise(name).tests
        mine = {t: r for t, r in results.items() if any(t.startswith(s) for s in wanted)}
        for test, (status, why) in mine.items():
            if not quiet or status != "PASS":
                print(f"{status} {test}" + (f"  ({why})" if why else ""))
        ok = bool(mine) and all(status == "PASS" for status, _ in mine.values())
        verdict[name] = ok
        print(
            f"exercise {name}: {sum(s == 'PASS' for s, _ in mine.values())}/{len(mine)} tests pass -> "
            f"{'PASS' if ok else 'FAIL'}",
            flush=True,
        )
    return verdict


def read_report(path):
    """{node id: (PASS | FAIL | SKIP, the reason)} from the grader plugin's lines: a test fails when
    any of its phases failed (setup, call or teardown; the first failure's reason), is skipped when
    one was skipped (a skipped test graded nothing: not a pass), and passes otherwise."""
    out = {}
    for line in path.read_text().splitlines():
        phase = json.loads(line)
        status, _ = out.get(phase["node"], ("PASS", ""))
        if phase["outcome"] == "failed" and status != "FAIL":
            out[phase["node"]] = ("FAIL", phase["reason"])
        elif phase["outcome"] == "skipped" and status == "PASS":
            out[phase["node"]] = ("SKIP", phase["reason"])
        else:
            out.setdefault(phase["node"], ("PASS", ""))
    return out


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python lessons/check.py",
        description="Grade an exercise: your file plugged into our tests.",
    )
    parser.add_argument(
        "--exercise",
        nargs=2,
        action="append",
        metavar=("NAME", "FILE"),
        default=[],
        help="an exercise and your file (repeat to grade several in one run)",
    )
    parser.add_argument(
        "--predict",
        metavar="FILE",
        help="your predictions (lessons/exercises/predictions.py's form)",
    )
    parser.add_argument(
        "-x", "--first-failure", action="store_true", help="stop at the first failing test"
    )
    parser.add_argument("--quick", action="store_true", help="only the first test of each exercise")
    parser.add_argument("--list", action="store_true", help="list the exercises")
    args = parser.parse_args(argv)
    if args.list or not (args.exercise or args.predict):
        width = max(map(len, EXERCISES))
        for name, ex in EXERCISES.items():
            print(f"{name:>{width}}  lesson {ex.lesson}  {ex.what}")
        return 0
    ok = True
    try:
        if args.exercise:
            ok = all(
                grade(args.exercise, first_failure=args.first_failure, quick=args.quick).values()
            )
        if args.predict:
            sys.path.insert(0, str(LESSONS))
            import predict  # lessons/predict.py

            ok = predict.grade(args.predict) and ok
    except ValueError as error:  # a wrong name or file: one line, no traceback
        print(f"error: {error}")
        return 2
    return 0 if ok else 1
