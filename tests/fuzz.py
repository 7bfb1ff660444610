"""A property-based layout fuzzer: every valid layout equals the dense model, every invalid one is
refused in one line before any collective.

Idea: Hypothesis draws a configuration from the declared flags (nanomega/job/config.py): each value
must pass the flag's declared range, a string flag takes its concept's own tuple of choices, and
the draw is built to satisfy the couplings it can (world = tp x pp x cp x dp, ep inside dp, tp
dividing the heads, interleaved's virtual stages); checks.check, the trainer's own gate, rejects the
rest (`assume`). The property: STEPS steps of that layout equal the one-process run of the same
model (the same flags less the layout's, cached per model): every step's loss within
tolerance.layout_rtol; step 1's gradients (read from its checkpoint's first moments) within
tolerance.gradient_bound, element by element; the weights after step 1 within what Adam's first
step makes of that (tolerance.adam_first_step_bound). The final weights' largest difference is
printed with a failure, not asserted (check_layout says why). FP8 is compared with one-process FP8
on the same micro-batches; with tp or cp, by its losses alone (check_layout). The invalid half draws
out-of-range values, unknown choices and loose layouts checks.check refuses, and asserts
train.py's entrypoint says one line naming a flag, exits 2, reaches no collective and writes
nothing. A failure shrinks to the smallest configuration; its `torchrun` command is printed.

    python -m tests.fuzz --minutes 60 [--seed S] [--max-world 8] [--min-world 2]   the long mode
    NANOMEGA_FUZZ_SEED=S python -m pytest tests/test_fuzz.py          the CI sample, another seed
Lesson: lessons/15-3d-parallelism.md
"""

import argparse
import collections
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from unittest import mock

import hypothesis
from hypothesis import assume, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tolerance.py, as pytest imports it

from nanomega import (
    checkpoint,
    cp,
    dist,
    gpt_config,
    moe,
    recompute,
    reshard,
    schedules,
    train,
    worlds,
)  # noqa: E402
from nanomega.job import checks, flags, lifecycle
from nanomega.tools import corpus as documents  # noqa: E402
from tolerance import (  # noqa: E402
    adam_first_step_bound,
    gradient_bound,
    gradient_rtol,
    layout_rtol,
)

ROOT = Path(__file__).resolve().parent.parent
# Hypothesis's own files (its constants and unicode caches; the example database is off: SETTINGS)
# outside the checkout
hypothesis.configuration.set_hypothesis_home_dir(
    Path(tempfile.gettempdir()) / "nanomega-hypothesis"
)
# the CI sample's seed: its 3 layouts hold MLA, MoE at ep 2 with pp 2, FP8 (rowwise, and tensorwise
# at tp 2); any other seed draws another sample
SEED = int(os.environ.get("NANOMEGA_FUZZ_SEED", 58))
STEPS, GLOBAL_BATCH, LR = 3, 8, 3e-3
# the tiny model every example trains; what the fuzzer does not draw (see NOT_DRAWN)
FIXED = dict(
    n_head=4,
    n_embd=32,
    block_size=32,
    dropout=0.0,
    max_steps=STEPS,
    warmup=1,
    lr=LR,
    eval_every=0,
    log_every=100,
    peak_flops=1e11,
    save_every=1,  # step 1's checkpoint: its Adam moments hold the first gradients
)
TOKENS = GLOBAL_BATCH * FIXED["block_size"]  # the terms of a gradient element, at most
BETA1 = 0.9  # AdamW's (compose.py): step 1's exp_avg is (1 - BETA1) g

# string flags whose choices live in their concept module (job/config.py declares only the help)
CHOICES = {
    "arch": gpt_config.ARCHS,
    "attention": gpt_config.ATTENTION,
    "router": moe.ROUTERS,
    "cp_method": cp.METHODS,
    "schedule": tuple(schedules.SCHEDULES),
    "recompute": recompute.MODES,
}
FP8_FLAG = next(f for f in flags.FLAGS if f.name == "fp8")
FP8 = tuple(r for r in FP8_FLAG.metadata["argparse"]["choices"] if r != "off")  # its recipes
# the flags that say how the same model is laid out and computed: the one-process reference drops
# them (one reference per model, optimizer and data)
LAYOUT = {
    "tp",
    "pp",
    "cp",
    "ep",
    "sequence_parallel",
    "cp_method",
    "schedule",
    "virtual_stages",
    "zero",
    "offload",
    "offload_params",
    "recompute",
    "recompute_layers",
    "fused",
    "attention",
    "batch_size",
    "grad_accum",
    *("dp_shard", "zeropp_qwz", "zeropp_hpz", "zeropp_qgz"),
}
# every other flag, and why it is not drawn: a new flag fails tests/test_fuzz.py until it is
# drawn (layouts below) or named here
NOT_DRAWN = {
    **dict.fromkeys(FIXED, "the tiny model and a short run (FIXED)"),
    "dropout": "its mask depends on the layout's RNG streams: no layout equals another with it",
    "dtype": "16-bit: the model is cast, so every activation is rounded to u = 2^-8 (bf16; fp16 "
    "2^-11), 2^16 times fp32's, and where is the layout's (tp rounds each row-parallel partial sum "
    "before its all-reduce, one process the whole sum once); layout_rtol's per-term form with that "
    "u exceeds 1 at 3 steps, and a probabilistic bound needs the reference's own sum over "
    "activations of (a dL/da)^2 (hooks on every op): open",
    "model": "a preset sets the shape flags, which are drawn directly",
    "rope_theta": "a value of the positions, not a layout: any layout computes it alike",
    "rope_scaling": "as rope_theta",
    **dict.fromkeys(
        ("rope_type", "rope_original_context", "rope_mscale_all_dim"),
        "as rope_theta (dynamic NTK, whose table follows the length, is refused with --cp)",
    ),
    "tensorboard": "logging only: tests/test_tensorboard.py",
    **dict.fromkeys(
        ("mtp_num_layers", "mtp_loss_scaling_factor"),
        "multi-token prediction: tests/test_mtp.py holds its layouts (dp2 with uneven valid "
        "targets per rank, dp2 ZeRO-3 + full recompute, pp2 1F1B / ZB-H1, tp2, tp2 + SP, against "
        "one process); drawing it here (with Muon, fused kernels, other schedules) is open",
    ),
    "norm_eps": "as rope_theta",
    "moe_aux_loss": "drawn through moe_z_loss's path (the same router loss reduction)",
    "min_lr": "the schedule's value: no layout computes it otherwise",
    "post_validate": "bitwise the synchronized step wherever it runs (tests/test_post_validate.py: "
    "clipped and not)",
    "weight_decay": "as min_lr",
    "eval_iters": "evaluation is off (eval_every 0): tests/test_pipeline_eval.py's",
    "seed": "one data order and init per run: the property holds per seed",
    "global_batch": "drawn as batch_size x grad_accum x dp = GLOBAL_BATCH",
    **dict.fromkeys(
        ("tokenizer", "corpus", "text_field", "data", "data_cache", "out_dir"),
        "where the data and the outputs are: the examples' own",
    ),
    **dict.fromkeys(
        ("device", "tf32", "compile"), "the device and torch.compile: the CPU suite's eager path"
    ),
    **dict.fromkeys(
        ("save_every_minutes", "async_save", "flash_restore", "keep_last"),
        "checkpoints: the resume tests' (one save at the end is what the property reads)",
    ),
    **dict.fromkeys(
        ("resume", "resume_from", "allow_tokenizer_change", "allow_arithmetic_change"),
        "resuming: tests/test_layouts.py and the resume tests",
    ),
    **dict.fromkeys(
        (
            "on_nan",
            "max_skipped",
            "on_spike",
            "spike_threshold",
            "rollback_lr_factor",
            "collective_timeout",
            "hang_timeout",
            "health_check",
            "inject_fault",
        ),
        "failure handling: the fault tests' (a healthy run never triggers it)",
    ),
    **dict.fromkeys(
        ("dry_run", "rank", "world"), "--dry-run builds one rank on paper, trains none"
    ),
    **dict.fromkeys(
        ("first_k_dense", "dense_ffn_hidden"),
        "dense blocks before MoE ones: tests/test_moe_dense.py holds their layouts (dp2 x ep2 x "
        "pp2, whose first stage has no MoE block, and dp2 x ep2 x tp2, against one process); "
        "drawing them here is open",
    ),
    "qk_norm_whole": "OLMoE's QK-norm, refused with --tp > 1 (its norm spans the heads tp splits): "
    "tests/test_hf_moe.py holds it against transformers' OLMoE; drawing it here is open",
}
# what layouts() draws: with NOT_DRAWN, every flag of job/config.py
DRAWN = {
    *("arch", "n_layer", "alibi", "embed_layernorm", "n_kv_head", "ffn_hidden", "tie_embeddings"),
    *("n_experts", "top_k", "router", "capacity_factor", "shared_experts", "moe_z_loss"),
    *("moe_bias_balance", "document_mask", "optimizer", "grad_clip"),
    *("qkv_bias", "qk_norm", "shared_expert_gate", "n_group", "topk_group", "routed_scaling"),
    *("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    *("fp8", "fp8_block", "fp8_history", "fp8_min_dim", "onebit_warmup"),
    *LAYOUT,
}
VERBOSE = False  # the long mode prints each layout and its margins
COVERAGE = collections.Counter()  # (axis, value) -> examples run, for the reports
MARGINS = collections.Counter()  # check -> the largest |difference| / bound seen


def declared(values):
    """The drawn values, each checked against its flag's declaration: a known flag, in its declared
    range (job/ranges.py's rules) and among its choices."""
    fields = {f.name: f for f in flags.FLAGS}
    c = checks.dataclasses.replace(flags.parse([]), **values)
    for name, v in values.items():
        assert name in fields and name in DRAWN, (
            f"{name}: not a flag of job/config.py, or not in DRAWN"
        )
        ok, text = flags.RANGES.get(name, (lambda v, c: True, ""))
        assert v is None or ok(v, c), f"--{name} {v} drawn outside its range {text}"
        choices = fields[name].metadata["argparse"].get("choices") or CHOICES.get(name)
        assert choices is None or v in choices, f"--{name} {v!r} is not one of {choices}"
    return values


def note(text):
    """Printed with a failing example's report (and only then); outside Hypothesis: nowhere."""
    with contextlib.suppress(hypothesis.errors.InvalidArgument):
        hypothesis.note(text)


def divisors(n, of=None):
    return [d for d in range(1, n + 1) if n % d == 0 and (of is None or of % d == 0)]


@st.composite
def layouts(draw, max_world=4, loose=False, min_world=1):
    """A configuration as {flag: value} and its world size. loose: the sizes drawn independently
    (the invalid half's couplings); else built to fit a world of min_world..max_world ranks."""
    c, pick = {}, lambda xs: draw(st.sampled_from(list(xs)))
    # the model: family and its options
    family = pick(("gpt2", "llama", "moe"))
    c["arch"] = "gpt2" if family == "gpt2" else "llama"
    c["n_layer"] = pick((2, 4))
    if family == "gpt2":
        c.update(alibi=draw(st.booleans()), embed_layernorm=draw(st.booleans()))
    else:
        c.update(ffn_hidden=64, tie_embeddings=draw(st.booleans()))
        if draw(st.booleans()):  # multi-head latent attention (mla.py; 0: a size from the heads)
            c.update(kv_lora_rank=pick((8, 16)), q_lora_rank=pick((0, 12)))
            c.update(qk_nope_head_dim=pick((0, 4)), qk_rope_head_dim=pick((0, 2)))
            c["v_head_dim"] = pick((0, 6))
        else:  # its own keys and values: GQA, Qwen2's q/k/v biases, Qwen3's QK-norm are MHA's
            c.update(n_kv_head=pick((0, 1, 2)), qkv_bias=draw(st.booleans()))
            c["qk_norm"] = draw(st.booleans())
    if family == "moe":
        c.update(n_experts=pick((2, 4)), top_k=pick((1, 2)), router=pick(CHOICES["router"]))
        c.update(capacity_factor=pick((0.0, 1.0)), shared_experts=pick((0, 1)))
        c.update(moe_z_loss=pick((0.0, 1e-3)), moe_bias_balance=pick((0.0, 1e-3)))
        c["shared_expert_gate"] = c["shared_experts"] > 0 and draw(st.booleans())  # Qwen2-MoE's
        if c["router"] == "deepseek_v3":  # its group limit (groups of >= 2) and routed scaling
            c["n_group"] = pick(d for d in (1, 2) if c["n_experts"] // d >= 2)
            c["topk_group"] = pick(range(1, c["n_group"] + 1))
            c["routed_scaling"] = pick((1.0, 2.5))

    # the layout: world = tp x pp x cp x dp, ep carved out of dp (drawn first: dp a multiple of it)
    world = pick(range(min_world, max_world + 1))
    experts = family == "moe" and not loose  # the draw keeps to what experts run with
    if loose:
        c.update(tp=pick((1, 2, 3, 4)), pp=pick((1, 2, 3, 4)), cp=pick((1, 2, 4)))
        c.update(ep=pick((1, 2, 4)), grad_accum=pick((1, 2, 3, 4)), batch_size=pick((1, 2)))
    else:
        c["ep"] = pick(divisors(world, of=c.get("n_experts", 1)))
        rest = world // c["ep"]  # tp x pp x cp x (dp / ep)
        c["tp"] = pick(divisors(rest, of=FIXED["n_head"]))
        c["pp"] = pick(d for d in divisors(rest // c["tp"]) if d <= c["n_layer"])
        # experts see whole sequences (checks.check_experts): no cp, no SP
        c["cp"] = 1 if experts else pick(divisors(rest // (c["tp"] * c["pp"]), of=2))
        dp = world // (c["tp"] * c["pp"] * c["cp"])
        assume(GLOBAL_BATCH % dp == 0)
        c["grad_accum"] = pick(divisors(GLOBAL_BATCH // dp))
        c["batch_size"] = GLOBAL_BATCH // dp // c["grad_accum"]
    if c["tp"] > 1 and not experts:
        c["sequence_parallel"] = draw(st.booleans())
    if c["cp"] > 1:
        c["cp_method"] = pick(CHOICES["cp_method"])
    if c["pp"] > 1:
        # zb-v, dualpipev: two chunks per rank in a V, so 2 pp layers at least (pp.check_args);
        # dualpipev 2 pp micro-batches at least (dualpipe.check); drawn where the model and the
        # batch have them (zb-h2, as zb-h1, takes any layout 1f1b does)
        fits = {
            "zb-v": loose or 2 * c["pp"] <= c["n_layer"],
            "dualpipev": loose or 2 * c["pp"] <= min(c["n_layer"], c["grad_accum"]),
        }
        c["schedule"] = pick(s for s in CHOICES["schedule"] if fits.get(s, True))
        c["virtual_stages"] = 2 if c["schedule"] in ("interleaved", "zb-v", "dualpipev") else 1

    # the engine (experts: ZeRO-0..2 without offload, ep.check_engine), the arithmetic, the kernels
    # (beside pp only ZeRO-0/1: zero_rules.pipeline_error; the loose draw finds that refusal)
    stages = (0, 1) if c["pp"] > 1 and not loose else (0, 1, 2) if experts else (0, 1, 2, 3)
    c["zero"] = pick(stages)
    if c["zero"] and not experts:
        c["offload"] = pick((0.0, 0.5, 1.0))
        c["offload_params"] = c["zero"] == 3 and c["offload"] == 1.0 and draw(st.booleans())
    c["recompute"] = pick(CHOICES["recompute"])
    if c["recompute"] != "none":
        c["recompute_layers"] = pick((None, 1))
    c.update(fused=draw(st.booleans()), attention=pick(CHOICES["attention"]))
    c.update(document_mask=draw(st.booleans()), optimizer=pick(("adamw", "muon")))
    c["grad_clip"] = pick((1.0, 0.0, 0.05))  # 0.05 clips every step
    split = c.get("schedule") in schedules.SPLIT  # fp8_linear.check: not composed with W ops
    if draw(st.booleans()) and (loose or (c["ep"] == 1 and not split)):
        c["fp8"] = pick(fp8_recipes(c) if not loose else FP8)  # the blocks' linears in FP8
        if c["fp8"] == "blockwise":
            c["fp8_block"] = pick((16, 32))
        if c["fp8"] == "delayed":
            c["fp8_history"] = pick((1, 16))
        c["fp8_min_dim"] = 0 if c["tp"] > 1 and not loose else pick((0, 16))  # 16: narrow ones
    less_traffic(c, draw, pick, world, loose)  # drawn last: the draws above keep their order
    return declared(c), world


def less_traffic(c, draw, pick, world, loose):
    """Issue 46's flags where each keeps the parity property: hybrid sharding (--dp-shard S, a
    divisor of dp, ZeRO-1/2/3 over tp x dp), hpZ (ZeRO-3 over hosts of S: plain ZeRO-3's values,
    gathered inside) and 1-bit Adam inside its warm-up (AdamW's steps: its compressed steps differ
    from the dense run by design, tests/test_onebit.py). qwZ and qgZ round the weights / gradients
    blockwise (no layout tolerance covers them: tests/test_zeropp.py's bounds): drawn loose only,
    with the sizes and the other switches, for the one-line refusals of what does not compose."""
    if loose:
        c.update(dp_shard=pick((0, 2, 3)), zeropp_hpz=draw(st.booleans()))
        c.update(zeropp_qwz=pick((0, 4, 8)), zeropp_qgz=pick((0, 4, 8)))
    else:
        dp = world // (c["tp"] * c["pp"] * c["cp"])
        hybrid = c["zero"] and dp > 1 and c["pp"] == c["cp"] == c["ep"] == 1
        c["dp_shard"] = pick(divisors(dp)[:-1]) if hybrid and draw(st.booleans()) else 0
        fits = c["zero"] == 3 and c["dp_shard"] and not c.get("offload")
        c["zeropp_hpz"] = bool(fits) and draw(st.booleans())
    # 1-bit Adam where it runs (onebit.check: ZeRO-0, no pp, no ep), in place of AdamW
    onebit = loose or (c["zero"] == 0 and c["pp"] == c["ep"] == 1)
    if onebit and c["optimizer"] == "adamw" and draw(st.booleans()):
        c["optimizer"] = "onebit"
        c["onebit_warmup"] = pick((STEPS, 100)) if not loose else pick((1, STEPS))


def fp8_recipes(c):
    """The --fp8 recipes fp8_linear.check runs with this layout (its other refusals: the check)."""
    no = {"delayed", "rowwise"} if c["tp"] > 1 else set()  # a tp shard's row amax: not built
    no |= {"blockwise", "mxfp8"} if c["cp"] > 1 else set()  # 16/32-token tiles: 8 tokens a chunk
    no |= set(FP8) - {"tensorwise"} if c["zero"] == 3 else set()  # fp8_gather.py's recipe
    # delayed at dp > 1 or pp > 1: its history rolls when a weight's next forward starts, so
    # which amax a scale has seen follows the ranks' micro-batches and the schedule's order (found
    # here; fp8_linear.check now refuses it: test_fuzz.py's regression test)
    split = c["batch_size"] * c["grad_accum"] < GLOBAL_BATCH or c["pp"] > 1
    no |= {"delayed"} if split else set()
    return [r for r in FP8 if r not in no]


def argv(values, corpus, out, cache=None):
    """train.py's command line: FIXED, the drawn flags, the data (its cache: out/../cache unless
    given) and the out-dir."""
    fields = {f.name: f for f in flags.FLAGS}
    args = []
    for name, v in {**FIXED, **values}.items():
        opt, f = flags.options(fields[name])[0], fields[name]
        if v == flags.default(name):  # the command says only what differs
            continue
        if f.type is bool:  # a switch
            args.append(opt)
        elif v is not None:
            args.append(f"{opt}={v}")
    return [
        *args,
        "--corpus",
        str(corpus),
        "--data-cache",
        str(cache or out.parent / "cache"),
        "--out-dir",
        str(out),
    ]


def command(values, world, corpus, out):
    line = shlex.join(argv(values, corpus, out))
    return f"torchrun --standalone --nproc_per_node={world} nanomega/train.py {line}"


@contextlib.contextmanager
def environment(world):
    """Rank 0 of a `world`-rank job, as torchrun's environment says (checks.world_size reads it)."""
    saved = dict(os.environ)
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def refused(values, world, corpus):
    """checks.check's one line for this configuration, or None when it is accepted (pure: no file,
    no collective)."""
    with environment(world), contextlib.redirect_stdout(io.StringIO()):
        try:
            checks.check(flags.parse(argv(values, corpus, Path(tempfile.gettempdir()) / "x")))
        except ValueError as e:
            return str(e)
    return None


class Data:
    """The examples' corpus (short .jsonl documents: --document-mask has something to mask) and the
    one-process references, made once per process."""

    def __init__(self, root=None):
        self.root = Path(root or tempfile.mkdtemp(prefix="nanomega-fuzz-"))
        self.corpus, self.references, self.n = write_corpus(self.root / "docs.jsonl"), {}, 0
        self.passed = set()  # the layouts already shown equal (a later round draws others)
        # tokenized once, here: a rank of a local world is a daemon process, which cannot start
        # tools/corpus.py's pool of tokenizer workers
        self.cache = self.root / "cache"
        documents.cached(
            self.corpus,
            flags.default("tokenizer"),
            self.cache,
            workers=1,
            text_field=flags.default("text_field"),
            progress=False,
        )

    def reference(self, values):
        """The one-process run of the same model, optimizer and data: (its flags, its result)."""
        flat = reference_flags(values)
        key = json.dumps(flat, sort_keys=True)
        if key not in self.references:
            out = self.root / f"reference-{len(self.references)}" / "out"
            worlds.launch(run, 1, argv(flat, self.corpus, out, self.cache), timeout=600)
            self.references[key] = flat, result(out)
        return self.references[key]

    def example(self, values, world):
        self.n += 1
        out = self.root / f"example-{self.n}" / "out"
        worlds.launch(run, world, argv(values, self.corpus, out, self.cache), timeout=600)
        return out


def reference_flags(values):
    """The one-process run's flags: the same model less the layout's flags. Under FP8 with the
    layout's micro-batches and kernels too: a current scale is a whole tensor's (amax MAX-reduced
    over tp and cp), so the same micro-batch gives the same scales."""
    model = {k: v for k, v in values.items() if k not in LAYOUT}
    if fp8(values):
        model.update({k: values[k] for k in ("batch_size", "fused", "attention") if k in values})
    batch = model.get("batch_size", GLOBAL_BATCH)
    return {**model, "batch_size": batch, "grad_accum": GLOBAL_BATCH // batch}


def fp8(values):
    return values.get("fp8", "off") != "off"


def depth(values):
    """The reductions a logit passes through (tolerance.layout_rtol's depth): 4 a layer (the
    attention's input and output, the MLP's two), MLA's latents 2 more (down, then up), the head."""
    return values["n_layer"] * (6 if values.get("kv_lora_rank") else 4) + 1


def write_corpus(path, chars=200_000):
    """The first `chars` characters of the embedded corpus, every line a document (as
    tests/test_cp.py's docs_corpus); `python -m tests.fuzz --write-corpus PATH` writes it for a
    printed command."""
    import gzip

    text = gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(chars)
    lines = (json.dumps({"text": line}) + "\n" for line in text.split("\n") if line.strip())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(lines))
    return Path(path)


def run(args):
    """One rank of a world: train.py on these flags, quiet."""
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(args)
    return True


def result(out):
    """(losses per step, step 1's {name: (full weights, full optimizer state)}, final full weights
    by name) of a finished run."""
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    first = reshard.full_checkpoint(dict(checkpoint.step_folders(out))[1])
    final = reshard.full_weights(checkpoint.latest(out))
    return [r["loss"] for r in recs if "loss" in r], first, final


def first_moments(first):
    """{name: step 1's first moment}: AdamW's exp_avg, (1 - BETA1) g, or Muon's momentum buffer,
    a fixed multiple of g too: the first gradients (clipped), before any optimizer's step."""
    moments = {k: s.get("exp_avg", s.get("momentum_buffer")) for k, (_, s) in first.items()}
    return {k: m for k, m in moments.items() if m is not None}  # frozen: none


def first_step(first, ref_first, depth=17):
    """(step 1's gradients, weights after step 1), each as the largest |difference| / bound over
    the model (a name beside it), against the one-process run's: bounds from the arithmetic
    (tolerance.gradient_bound; the weights: tolerance.adam_first_step_bound, on AdamW's elements;
    Muon's orthogonalized steps are not element-wise)."""
    got, want = first_moments(first), first_moments(ref_first)
    n = sum(m.numel() for m in want.values())
    rtol = gradient_rtol(TOKENS, vocab=4096, width=128, depth=depth, n_params=n)
    bounds = gradient_bound(want, TOKENS, rtol)
    ratio = {k: ((got[k].double() - m).abs() / bounds[k]).max().item() for k, m in want.items()}
    grads = max((r, k) for k, r in ratio.items())
    weights = (0.0, "")
    for k, (w, state) in ref_first.items():
        if "exp_avg" in state and state["exp_avg"].numel():  # AdamW's
            g, bound = want[k] / (1 - BETA1), bounds[k] / (1 - BETA1)
            allowed = adam_first_step_bound(g, bound, w, LR)
            weights = max(weights, (((first[k][0].double() - w).abs() / allowed).max().item(), k))
    return grads, weights


def check_layout(data, values, world):
    """The property: this layout's every loss, its first gradients and its weights after the first
    step equal the one-process run's. FP8 with tp or cp: the losses alone (below)."""
    flat, (ref_losses, ref_first, ref_weights) = data.reference(values)
    note(f"layout:    {command(values, world, 'docs.jsonl', Path('out/layout'))}")
    note(f"reference: {command(flat, 1, 'docs.jsonl', Path('out/reference'))}")
    note("docs.jsonl: python -m tests.fuzz --write-corpus docs.jsonl")
    for name, v in {**values, "world": world}.items():
        COVERAGE[name, v] += 1
    say(f"layout {data.n + 1}: {world} rank(s) {json.dumps(values)}")
    losses, first, weights = result(data.example(values, world))
    assert len(losses) == STEPS and first.keys() == ref_first.keys(), (len(losses), first.keys())
    rtol = layout_rtol(STEPS, vocab=4096, width=128, depth=depth(values))
    ratio = max(abs(a - b) / (rtol * abs(b)) for a, b in zip(losses, ref_losses))
    MARGINS["losses"] = max(MARGINS["losses"], ratio)
    wrong = [
        f"step {i}: loss {a} vs one process's {b} (rtol {rtol:.2g})"
        for i, (a, b) in enumerate(zip(losses, ref_losses), 1)
        if not abs(a - b) <= rtol * abs(b)
    ]
    # step 1: the gradients and the weights after it, each within its bound (ratio <= 1). FP8 with
    # tp or cp: a partial sum rounded in another order flips an FP8 code (one spacing, 2^-3
    # relative), far past an fp32 element's bound; the losses average such flips (their mean
    # effect is the perturbation itself: tests/test_fp8_train.py), so they alone are asserted.
    # Elsewhere FP8's forward is the reference's, bitwise (the same micro-batches and kernels).
    (grads, at), (step1, at1) = first_step(first, ref_first, depth(values))
    note(f"step 1: gradients {grads:.3g}x their bound ({at}), weights {step1:.3g}x ({at1})")
    if not (fp8(values) and (values["tp"] > 1 or values["cp"] > 1)):
        MARGINS["gradients"] = max(MARGINS["gradients"], grads)
        MARGINS["weights after step 1"] = max(MARGINS["weights after step 1"], step1)
        wrong += [f"step 1's gradient of {at}: {grads:.3g}x its bound"] * (not grads <= 1)
        wrong += [f"weights of {at1} after step 1: {step1:.3g}x the bound"] * (not step1 <= 1)
    # the final weights are reported, not asserted: from step 2 on, Adam's g / sqrt(v) turns
    # step 1's sign flips where a gradient is at its rounding floor (allowed: up to 2 lr) into
    # different gradients, by the loss's curvature, which no rounding bound knows (seen:
    # --attention eager vs sdpa, one embedding element 0.0019 apart after 3 steps); the losses
    # carry the weights' effect
    drift = max((weights[k] - b).abs().max().item() for k, b in ref_weights.items())
    note(f"largest final weight difference from one process's: {drift:.3g}")
    say(f"  losses {ratio:.3g}x their bound, step 1's gradients {grads:.3g}x, weights {step1:.3g}x")
    assert not wrong, wrong
    data.passed.add(json.dumps([values, world], sort_keys=True))


def say(text):
    """A line of the long mode's log (quiet under pytest)."""
    if VERBOSE:
        print(text, flush=True)


class CollectiveReached(Exception):
    """A refusal must come before the process group exists (not a RuntimeError: the entrypoint
    would read it as a job's failure)."""


def out_of_range(name):
    """Values --name's declared range refuses (the rule itself is the filter): NaN and infinities
    for a float, any integer for an int; judged against the FIXED flags (--min-lr <= --lr)."""
    field = next(f for f in flags.FLAGS if f.name == name)
    ok, base = flags.RANGES[name][0], checks.dataclasses.replace(flags.parse([]), **FIXED)
    number = st.integers(-(2**64), 2**64)
    if flags.kind(field).get("type") is float:
        number = number | st.floats(allow_nan=True, allow_infinity=True)
    return number.filter(lambda v: not ok(v, base))


@st.composite
def invalid(draw, max_world=8):
    """(values, world, the flags its line must name: any flag when empty): an out-of-range value,
    an unknown choice, or a loose layout (the caller keeps those checks.check refuses)."""
    kind = draw(st.sampled_from(("range", "choice", "coupling")))
    if kind == "range":
        name = draw(st.sampled_from(sorted(flags.RANGES)))
        return {name: draw(out_of_range(name))}, 1, [name]
    if kind == "choice":
        declared_choices = {f.name: f.metadata["argparse"].get("choices") for f in flags.FLAGS}
        table = {**{k: v for k, v in declared_choices.items() if v}, **CHOICES}
        name = draw(st.sampled_from(sorted(table)))
        word = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=8)
        return {name: draw(word.filter(lambda w: w not in table[name]))}, 1, [name]
    values, world = draw(layouts(max_world, loose=True))
    return values, world, []


def check_refusal(data, values, world, names):
    """train.py's entrypoint as rank 0 of a `world`-rank job, in this process: exit 2, one line on
    stderr naming the flag, nothing on stdout, no process group started, nothing written."""
    with tempfile.TemporaryDirectory() as tmp:
        args, err, out = argv(values, data.corpus, Path(tmp) / "out"), io.StringIO(), io.StringIO()
        note(f"refused:   {command(values, world, 'docs.jsonl', Path('out/refused'))}")
        # dist.init: the one place a process group starts (train.start calls it)
        collective = mock.patch.object(dist, "init", side_effect=CollectiveReached)
        quiet = warnings.catch_warnings()  # torch's error handler: no fault handler on a StringIO
        with environment(world), collective, quiet, contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(out):
                try:
                    lifecycle.entrypoint(lambda: train.main(args))
                    code = 0
                except SystemExit as e:
                    code = e.code
        lines, written = err.getvalue().splitlines(), os.listdir(tmp)
    COVERAGE["refused", (names or ["coupling"])[0]] += 1
    assert code == 2 and len(lines) == 1 and not out.getvalue(), (
        code,
        err.getvalue(),
        out.getvalue(),
    )
    flag = [f"--{n.replace('_', '-')}" for n in names] or ["--"]
    assert lines[0].startswith("error: ") and any(f in lines[0] for f in flag), (lines, flag)
    assert not written, f"a refused job wrote {written}"


SETTINGS = dict(
    database=None,  # no .hypothesis folder: a failure is reproduced from the seed and its command
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    print_blob=False,
)


def fuzz_valid(data, seed, examples, max_world=4, min_world=1):
    """`examples` valid layouts of min_world..max_world ranks, drawn from `seed`, each equal to one
    process."""

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, **SETTINGS)
    @hypothesis.given(st.data())
    def valid(d):
        values, world = d.draw(layouts(max_world, min_world=min_world))
        assume(json.dumps([values, world], sort_keys=True) not in data.passed)
        here = Path("out")  # the reference's own command is no layout (the first draw: defaults)
        assume(world > 1 or argv(values, "d", here) != argv(reference_flags(values), "d", here))
        assume(refused(values, world, data.corpus) is None)
        check_layout(data, values, world)

    valid()


def accepted(corpus, seed, examples, max_world=8):
    """The layouts of `examples` draws that checks.check accepts, none run: what the draw reaches."""
    found = []

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, **SETTINGS)
    @hypothesis.given(st.data())
    def draw(d):
        values, world = d.draw(layouts(max_world))
        if refused(values, world, corpus) is None:
            found.append((values, world))

    draw()
    return found


def fuzz_invalid(data, seed, examples, max_world=8):
    """`examples` invalid configurations, drawn from `seed`, each refused in one line."""

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, **SETTINGS)
    @hypothesis.given(st.data())
    def invalid_refused(d):
        values, world, names = d.draw(invalid(max_world))
        # a loose layout may be valid; an out-of-range value or an unknown choice never is
        assume(names or refused(values, world, data.corpus) is not None)
        check_refusal(data, values, world, names)

    invalid_refused()


def report():
    """The examples run, by axis: {flag: {value: count}}."""
    table = collections.defaultdict(dict)
    for (axis, value), n in sorted(COVERAGE.items(), key=str):
        table[axis][str(value)] = n
    table["largest |difference| / bound"] = {k: f"{v:.3g}" for k, v in MARGINS.items()}
    return dict(table)


def main(argv_=None):
    p = argparse.ArgumentParser(description="The layout fuzzer's long mode (tests/fuzz.py).")
    p.add_argument("--minutes", type=float, default=60.0, help="stop starting rounds after this")
    p.add_argument("--seed", type=int, default=SEED, help="the first round's seed (+1 per round)")
    p.add_argument("--max-world", type=int, default=8, help="ranks of the largest layout drawn")
    p.add_argument("--min-world", type=int, default=1, help="ranks of the smallest layout drawn")
    p.add_argument("--per-round", type=int, default=10, help="valid layouts per round")
    p.add_argument("--report", help="write the coverage by axis here (JSON)")
    p.add_argument("--write-corpus", metavar="PATH", help="write the examples' corpus and exit")
    a = p.parse_args(argv_)
    if a.write_corpus:
        return print(write_corpus(a.write_corpus))
    global VERBOSE
    data, start, seed, VERBOSE, found = Data(), time.time(), a.seed, True, []
    while time.time() - start < a.minutes * 60:
        print(f"round: seed {seed}, {data.n} layouts run so far", flush=True)
        halves = [
            lambda: fuzz_invalid(data, seed, 10 * a.per_round, a.max_world),
            lambda: fuzz_valid(data, seed, a.per_round, a.max_world, a.min_world),
        ]
        for name, half in zip(("invalid", "valid"), halves):  # a failure: printed, shrunk; next
            try:
                half()
            except Exception as e:
                traceback.print_exc()
                found.append(f"seed {seed} {name}: {str(e)[:300]}")
                found[-1] += " | " + " | ".join(getattr(e, "__notes__", []))
        seed += 1
        if a.report:
            Path(a.report).write_text(json.dumps({**report(), "found": found}, indent=1) + "\n")
    print(json.dumps({**report(), "found": found}, indent=1))


if __name__ == "__main__":
    main()
