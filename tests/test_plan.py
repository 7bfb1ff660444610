"""The planner's formulas against published figures, the dense model, and hand counts; the CLI end
to end."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanomega import dist, formulas as F, worlds
from nanomega.dist import RING
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import cast_model
from nanomega.recompute import apply_recompute, saved_bytes_per_layer
from nanomega.tp import apply_tensor_parallel
from nanomega.tools import cost as C, cost_time as CT, layouts, plan as P
from nanomega.formulas import model_flops_per_token

GPT3 = C.MODELS["gpt3-175b"]


def test_zero_paper_figure_1():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, fp16 params and grads + K=12 Adam
    # state
    gb = [sum(F.zero_state_bytes(7.5e9, stage, 64, 2, 2, 12)) / 1e9 for stage in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]
    assert gb[1] == pytest.approx(4 * 7.5 + 12 * 7.5 / 64, abs=1e-9)  # 2Psi + 2Psi + K Psi/Nd


@pytest.mark.parametrize("dtype,base,sharded", [("bf16", 6, 12), ("fp32", 8, 8)])
def test_megatron_distributed_optimizer_bytes_per_parameter(dtype, base, sharded):
    # Megatron-LM docs: bf16 params + fp32 grads = 18 bytes -> 6 + 12/d; fp32 = 16 -> 8 + 8/d
    n = 2**20 * 3 * 5  # divisible by every d below: no padding
    for d in (1, 2, 3, 8, 64):
        assert sum(F.zero_state_bytes(n, 1, d, *C.PRECISIONS[dtype])) / n == base + sharded / d
    assert sum(F.zero_state_bytes(n, 0, 64, *C.PRECISIONS[dtype])) / n == base + sharded


def test_zero_shards_round_up_and_stages_only_shrink():
    # 10 elements over 4 ranks: the largest shard has 3
    p, g, o = F.zero_state_bytes(10, 3, 4, 1, 1, 1)
    assert (p, g, o) == (3, 3, 3)
    totals = [sum(F.zero_state_bytes(1000, s, 8)) for s in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_dp_comm_bytes():
    n, d, B = 1000, 8, 2
    ar = F.dp_comm_bytes(n, 0, d, B)
    assert ar == 2 * (d - 1) / d * n * B  # ring all-reduce
    # reduce-scatter + all-gather
    assert F.dp_comm_bytes(n, 1, d, B) == F.dp_comm_bytes(n, 2, d, B) == ar
    assert F.dp_comm_bytes(n, 3, d, B) == 1.5 * ar  # + a second all-gather in backward
    assert F.dp_comm_bytes(n, 0, 1, B) == 0
    # grads reduced in fp32, params gathered in bf16; with 4 micro-batches stage 2 reduces each one,
    # 3 also gathers
    f = (d - 1) / d * n
    assert F.dp_comm_bytes(n, 1, d, 4, 2, micro_batches=4) == f * 4 + f * 2
    assert F.dp_comm_bytes(n, 2, d, 4, 2, micro_batches=4) == 4 * f * 4 + f * 2
    assert F.dp_comm_bytes(n, 3, d, 4, 2, micro_batches=4) == 4 * f * 4 + 8 * f * 2


def test_tp_and_pp_comm_bytes():
    b, s, h, t = 2, 16, 64, 4
    ar = 2 * (t - 1) / t * b * s * h * 2  # one ring all-reduce of (b, s, h) in 2-byte elements
    assert F.tp_comm_bytes_per_layer(b, s, h, t, 2) == 4 * ar
    # SP: RS + AG carry an all-reduce's bytes, + 2 backward re-gathers of the stored shards: 10
    # (t-1)/t bsh B, what lesson 06 measures (tp=2 and 4) against TP's 8 (t-1)/t
    ring = (t - 1) / t * b * s * h * 2
    assert F.tp_comm_bytes_per_layer(b, s, h, t, 2, sequence_parallel=True) == 10 * ring
    assert F.tp_comm_bytes_per_layer(b, s, h, t, 2, recompute="full") == 6 * ar
    assert F.tp_comm_bytes_per_layer(b, s, h, t, 2, True, "full") == 14 * ring
    assert F.tp_comm_bytes_per_layer(b, s, h, 1, 2) == 0
    assert F.pp_comm_bytes(b, s, h, t, 2, micro_batches=8, v=2) == 2 * 2 * 8 * b * s * h * 2 / t


def test_korthikanti_activation_formulas_gpt3():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B as in Korthikanti et al. Table 3
    sbh = s * b * h
    assert 5 * a * s / h == 80  # the paper: the attention term dominates GPT-3's 34
    coef = lambda **kw: F.activation_bytes_per_layer(s, b, h, a, **kw) / sbh
    assert coef() == 34 + 80
    assert coef(t=t) == 10 + 24 / t + 80 / t == 23
    assert coef(t=t, sp=True) == (34 + 80) / t
    assert coef(t=t, sp=True, recompute="selective") == 34 / t
    assert coef(t=t, recompute="selective") == 10 + 24 / t
    assert coef(recompute="selective") == 34
    assert coef(t=t, sp=True, recompute="full") == coef(recompute="full") == 2
    # both forms reduce to the unparallel one at t=1
    assert coef(t=1, sp=False) == coef(t=1, sp=True)
    # the paper's headline numbers: selective saves 70% (GPT-3) and 65% (MT-NLG, 5as/h = 64); ~5x
    # overall
    assert 1 - coef(sp=True, recompute="selective") / coef(sp=True) == pytest.approx(
        0.70, abs=0.005
    )
    assert 1 - 34 / (34 + 5 * 128 * 2048 / 20480) == pytest.approx(0.65, abs=0.005)
    m = C.MODELS["mt-nlg-530b"]
    ratio = F.activation_bytes_per_layer(
        s, b, m.n_embd, m.n_head, 8
    ) / F.activation_bytes_per_layer(s, b, m.n_embd, m.n_head, 8, True, "selective")
    assert ratio == pytest.approx(5, rel=0.02)


def test_pipeline_bubble_and_inflight():
    # unit clock, forward = backward = 1 tick: 1F1B takes 2(m + p - 1) ticks, each stage idles 2(p -
    # 1)
    p, m = 4, 8
    assert F.pipeline_bubble(p, m) == 2 * (p - 1) / (2 * (m + p - 1)) == 3 / 11
    assert F.pipeline_bubble(p, m, v=2) == (p - 1) / (2 * m + p - 1)
    assert F.pipeline_bubble(1, m) == 0
    assert 1 / (1 - F.pipeline_bubble(p, m, 2)) == pytest.approx(1 + (p - 1) / (2 * m))
    assert F.inflight_microbatches(p, m, "gpipe") == m
    assert F.inflight_microbatches(p, m, "1f1b") == p and F.inflight_microbatches(p, 2, "1f1b") == 2
    # interleaved: Korthikanti's L(1 + (p-1)/(p v)) layers = (p + (p-1)/v) stages' worth
    assert F.inflight_microbatches(p, m, "interleaved", 3) * (96 / p) == pytest.approx(
        96 * (1 + (p - 1) / (p * 3))
    )
    assert F.inflight_microbatches(1, m, "gpipe") == 1


LLAMA = dict(
    vocab_size=300,
    block_size=32,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    ffn_hidden=96,
    arch="llama",
)


@pytest.mark.parametrize(
    "kw",
    [
        dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64),
        dict(
            vocab_size=300,
            block_size=32,
            n_layer=3,
            n_head=2,
            n_embd=32,
            alibi=True,
            embed_layernorm=True,
        ),
        LLAMA,
        dict(LLAMA, tie_embeddings=False),
        dict(LLAMA, n_kv_head=0, ffn_hidden=0),
    ],
)
def test_parameter_and_flop_counts_match_the_dense_model(kw):
    cfg = GPTConfig(**kw)
    # the planner's Model is GPTConfig's shape (gpt_config.SHAPE_KEYS)
    model = C.Model.from_shape(vars(cfg))
    assert (model.kv_heads, model.ffn) == (cfg.kv_heads, cfg.ffn)
    gpt = GPT(cfg)
    params = dict(gpt.named_parameters())  # a tied head is the embedding: named once
    assert C.n_params(model) == sum(p.numel() for p in params.values())
    # N of 6N: what a matmul multiplies; lookups left out (positions; untied, the token embedding)
    lookups = {"embed.wpe.weight"} | ({"embed.wte.weight"} if not cfg.tie_embeddings else set())
    n = C.flops_params(model)
    assert n == sum(p.numel() for k, p in params.items() if k not in lookups)
    with FlopCounterMode(display=False) as counter:
        gpt(torch.zeros(1, cfg.block_size, dtype=torch.long))
    weights = sum(p.numel() for k, p in params.items() if p.dim() == 2 and k not in lookups)
    L, h, s = cfg.n_layer, cfg.n_embd, cfg.block_size
    # forward: 2 per weight; QK^T and AV
    assert counter.get_total_flops() / s == 2 * weights + 4 * L * h * s
    # the time model's matmul weights
    assert L * CT.layer_weights(model) == weights - cfg.padded_vocab_size * h
    assert F.flops_per_token(n, cfg.n_layer, cfg.n_embd, cfg.block_size) == model_flops_per_token(
        cfg
    )


def test_tensor_and_pipeline_parameter_shards():
    # by hand: qkv (3h/t x h) + 3h/t, proj (h x h/t) + h, fc (4h/t x h) + 4h/t, proj (h x 4h/t) + h,
    # 2 LN
    h, t = 64, 4
    assert (
        F.layer_params(h, t)
        == 3 * h * h // t
        + 3 * h // t
        + h * h // t
        + h
        + 4 * h * h // t
        + 4 * h // t
        + h * 4 * h // t
        + h
        + 4 * h
    )
    tiny = C.Model(4, 64, 4, 300, 32)
    wte = 512 // 2 * 64  # 300 padded to a multiple of 128 * tp = 256 -> 512, split over tp = 2
    first, last = C.stage_params(tiny, tp=2, pp=2)
    assert first == 2 * F.layer_params(64, 2) + wte + 32 * 64
    assert last == 2 * F.layer_params(64, 2) + 2 * 64 + wte  # ln_f and the head's own copy of wte
    assert C.n_params(C.MODELS["gpt2-124m"]) == 124_475_904  # nanoGPT's 123.69M + 786,432 positions


def test_llama_stage_shards():
    """Llama's pieces per TP rank and stage, by hand: q, o, gate, up, down split by t; k/v split
    when t divides the key/value heads, whole otherwise; RMSNorm scales (h) replicated; no position
    table; the untied head its own (V/t, h) matrix on the last stage, whatever pp."""
    h, a, f = 64, 4, 96
    assert (
        F.llama_layer_params(h, f, a, 2, 2)
        == (h * h + 2 * h * 16 * 2 + 2 * f * h + h * f + h * h) // 2 + 2 * h
    )
    # k/v whole
    assert (
        F.llama_layer_params(h, f, a, 2, 4) == (2 * h * h + 3 * h * f) // 4 + 2 * 16 * 2 * h + 2 * h
    )
    model = C.Model(4, h, a, 300, 32, arch="llama", n_kv_head=2, ffn_hidden=f, tie_embeddings=False)
    wte = 512 // 2 * h  # 300 padded to a multiple of 128 x 2, split over tp = 2
    first, last = C.stage_params(model, tp=2, pp=2)
    assert first == 2 * F.llama_layer_params(h, f, a, 2, 2) + wte  # no positions
    # the final RMSNorm and the untied head
    assert last == 2 * F.llama_layer_params(h, f, a, 2, 2) + h + wte
    assert C.n_params(model) == 4 * F.llama_layer_params(h, f, a, 2) + 2 * 384 * h + h
    tied = replace_run(model, tie_embeddings=True)
    assert C.stage_params(tied) == [C.n_params(model) - 384 * h]  # pp = 1: one matrix for both
    assert C.stage_params(tied, 2, 2) == [first, last]  # pp > 1: the last stage's copy, as untied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_activation_formula_is_what_autograd_saves(attention, dtype):
    """llama_activation_bytes_per_layer with the bytes of this model's own kernels equals, to the
    byte, what autograd keeps per layer (recompute.saved_bytes_per_layer) for grouped (2 of 4) and
    multi-head attention, with no, selective and full recompute; the meter also sees the rotary
    cos/sin tables in every block (one storage shared by all layers: not a per-layer cost, so the
    formula leaves them out)."""
    s, b, h, a, f, act = 32, 2, 64, 4, 96, dtype.itemsize
    # modern.py's kernels
    own = dict(act=act, norm=4 + act, swiglu=4, scores=4 + (act if act != 4 else 0), mask=1)
    x = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    for n_kv in (2, 4):
        cfg = GPTConfig(
            vocab_size=256,
            block_size=s,
            n_layer=2,
            n_head=a,
            n_kv_head=n_kv,
            n_embd=h,
            ffn_hidden=f,
            arch="llama",
            tie_embeddings=False,
            attention=attention,
        )
        torch.manual_seed(0)
        model = cast_model(GPT(cfg), dtype)
        for mode in ("none", "selective", "full"):
            apply_recompute(model, mode)
            measured = saved_bytes_per_layer(model, lambda: model(x, x))
            tables = 0 if mode == "full" else 2 * s * (h // a) * act
            want = F.llama_activation_bytes_per_layer(
                s, b, h, a, n_kv, f, recompute=mode, attention=attention, **own
            )
            assert list(measured.values()) == [want + tables] * 2, (n_kv, mode)
    # Llama 3 405B's per-layer count with the defaults (fused kernels, bf16, FlashAttention), TP 8 +
    # SP: sbh (8 + 4 + 6/16 + 6 x 3.25) / 8 + 8sb/8 + 4abs/8: 0.54 GB per layer and sequence
    s, h, a, f = 8192, 16384, 128, 53248
    assert (
        F.llama_activation_bytes_per_layer(s, 1, h, a, 8, f, 8, True)
        == s * h * (8 + 4 + 6 / 16 + 6 * f / h) / 8 + s + 4 * a * s / 8
    )


def _llama_tp_world():
    """4 ranks: tp 4 (k/v held whole: 2 key/value heads) and tp 2 (split), with and without SP,
    eager and sdpa: per rank, the bytes each layer saves and the tp wire bytes of one layer (a
    2-layer model less a 1-layer one)."""
    out = {}
    for t, grid in ((4, dist.Grid(1, 1, 4)), (2, dist.Grid(2, 1, 2))):
        for sp in (False, True):
            for attention in ("eager", "sdpa"):
                wire = []
                for n_layer in (1, 2):
                    torch.manual_seed(0)
                    model = GPT(
                        GPTConfig(
                            **dict(
                                LLAMA,
                                vocab_size=256,
                                n_layer=n_layer,
                                tie_embeddings=False,
                                attention=attention,
                            )
                        )
                    )
                    apply_tensor_parallel(model, grid.tp, sp)
                    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
                    grid.log.reset()
                    saved = saved_bytes_per_layer(model, lambda: model(x, x).backward())
                    wire.append(grid.log.wire_bytes("tp"))
                out[(t, sp, attention)] = (saved, wire[1] - wire[0])
    return out


def test_llama_tensor_parallel_activations_and_bytes_per_layer():
    """Under TP the formulas hold per rank: activations as llama_activation_bytes_per_layer(t, sp)
    (k/v whole on every rank at t = 4 > 2 key/value heads), and one layer's tp wire bytes are
    tp_comm_bytes_per_layer with 3 column-parallel inputs (q_proj and kv_proj gather apart) + the
    replicated gradients it all-reduces in fp32: the RMSNorm scales under SP (2h), and the whole k/v
    weight when it is held whole (2 n_kv (h/a) h)."""
    s, b, h, a, n_kv, f = 32, 2, 64, 4, 2, 96
    res = worlds.launch(_llama_tp_world, 4, timeout=300)
    own = dict(act=4, norm=8, swiglu=4, scores=4, mask=1)
    for rank in res:
        for (t, sp, attention), (saved, wire) in rank.items():
            want = F.llama_activation_bytes_per_layer(
                s, b, h, a, n_kv, f, t, sp, attention=attention, **own
            )
            # + rotary tables
            assert list(saved.values()) == [want + 2 * s * (h // a) * 4] * 2, (t, sp, attention)
            replicated = (2 * h if sp else 0) + (2 * n_kv * (h // a) * h if n_kv % t else 0)
            want = (
                F.tp_comm_bytes_per_layer(b, s, h, t, 4, sp, inputs=3)
                + RING["all_reduce"](t) * 4 * replicated
            )
            assert wire == want, (t, sp, attention)


# Grattafiori et al. 2024 (The Llama 3 Herd of Models), Table 4, 405B: seq 8192, 16M tokens (2,048
# sequences) per batch, BF16, no activation checkpointing; interleaved with 8 chunks per rank over
# Llama 3's split (the text: the first chunk holds only the embedding, the last only the head: 128
# slots / 16 ranks); FSDP priced as ZeRO-1
LLAMA3_RUN = C.Run(
    global_batch=2048,
    micro_batch=1,
    dtype="bf16",
    recompute="none",
    sp=True,
    zero=(1,),
    attention="sdpa",
    schedule="interleaved",
    chunks=8,
    split="llama3",
)


@pytest.mark.parametrize("gpus,dp,published", [(8192, 64, 430), (16384, 128, 400)])
def test_llama3_405b_table_4_out_of_sample(gpus, dp, published):
    """The time model, fitted on A100 runs of GPT-2-shaped models (TimeModel), predicts Llama 3 405B
    on H100s within 10% with no constant changed; plain 1F1B on the trainer's split (what nanomega
    can run: 126 layers do not interleave over 16 stages) pays a bubble Llama 3 did not, and misses
    by far."""
    llama, h100 = C.MODELS["llama3-405b"], C.GPUS["h100-80gb"]
    e = CT.evaluate(llama, h100, gpus, 8, 16, 1, LLAMA3_RUN)
    assert (e.dp, e.micro_batches, e.layers) == (dp, 2048 // dp, (7,) + (8,) * 14 + (7,))
    # no recompute: hardware FLOPs = model FLOPs
    assert e.tflops == pytest.approx(e.mfu * h100.peak_flops)
    assert e.tflops / 1e12 == pytest.approx(published, rel=0.10)
    plain = CT.evaluate(
        llama, h100, gpus, 8, 16, 1, replace_run(LLAMA3_RUN, schedule="1f1b", split="trainer")
    )
    assert plain.bubble == 15 / (2048 // dp + 15) and plain.tflops / 1e12 < 0.85 * published


def test_gpt3_and_opt_compute():
    # GPT-3 paper Table D.1: 3.14e23 training FLOPs for 175B on 300B tokens; 6ND with N = 175e9 is
    # 3.15e23
    assert 6 * 175e9 * 300e9 == pytest.approx(3.15e23)
    n = C.n_params(GPT3) - 2048 * 12288
    assert 6 * n * 300e9 == pytest.approx(3.14e23, rel=0.005)
    # OPT-175B: 992 A100s, ~33 days (model card); 300B tokens -> MFU ~36%; counting the recompute
    # forward (8ND) gives the hardware utilisation OPT reports, 147 TFLOP/s per GPU = 47% of 312
    opt = C.n_params(C.MODELS["opt-175b"]) - 2048 * 12288
    mfu = F.implied_mfu(6 * opt * 300e9, 33, 992, 312e12)
    assert mfu == pytest.approx(0.356, abs=0.002)
    assert mfu * 8 / 6 == pytest.approx(147 / 312, rel=0.02)


def test_flops_per_token_recompute():
    N, L, h, s = 1e9, 24, 2048, 2048
    base = F.flops_per_token(N, L, h, s)
    assert base == 6 * N + 12 * L * h * s
    assert F.flops_per_token(N, L, h, s, "full") == 8 * N + 16 * L * h * s  # one more forward
    assert F.flops_per_token(N, L, h, s, "selective") - base == 4 * L * h * s  # QK^T and AV again


def test_plan_gpt3_on_1024_a100():
    run = C.Run(global_batch=1536)
    ests = layouts.plan(GPT3, C.GPUS["a100-80gb"], 1024, run)
    fit = [e for e in ests if e.fits]
    assert fit and len(fit) < len(ests)
    assert all(e.memory <= 0.9 * 80 * 2**30 for e in fit) and all(
        e.memory > 0.9 * 80 * 2**30 for e in ests[len(fit) :]
    )
    assert [e.step_s for e in fit] == sorted(e.step_s for e in fit)
    assert all(e.tp * e.pp * e.dp == 1024 and 1536 % e.dp == 0 for e in ests)
    # DeepSpeed refuses ZeRO-2/3 with pipelines
    assert not any(e.zero >= 2 and e.pp > 1 for e in ests)
    best = fit[0]
    assert (best.tp, best.pp, best.dp, best.zero) == (8, 8, 16, 1)
    # recompute: hardware > model FLOPs
    assert 0.3 < best.mfu < 0.6 and best.tflops < best.mfu * 312e12 * 1.2
    assert best.tp_comm == 96 * (96 // 8) * F.tp_comm_bytes_per_layer(
        1, 2048, 12288, 8, 2, True, "selective"
    )
    # same layout, ZeRO-0 vs ZeRO-1: only the optimizer term changes, by a factor dp
    z0 = next(e for e in ests if (e.tp, e.pp, e.zero) == (8, 8, 0))
    assert z0.optim == pytest.approx(best.optim * 16, rel=1e-6) and z0.params == best.params


def test_cli_prints_ranked_table(capsys):
    P.main(["--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536", "--top", "3"])
    out = capsys.readouterr().out.splitlines()
    assert "GB/GPU" in out[1] and len(out) == 6
    assert out[2].split()[:4] == ["8", "8", "16", "1"]
    assert out[-1].startswith("recommended: tp=8 pp=8 dp=16 zero=1")
    steps = [float(line.split("|")[3].split()[0]) for line in out[2:5]]
    assert steps == sorted(steps)


def test_cli_explicit_shape(capsys):
    P.main(
        [
            "--layers",
            "4",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--vocab",
            "256",
            "--seq",
            "64",
            "--gpus",
            "4",
            "--global-batch",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert "220,544 parameters" in out and "MB/GPU" in out


def test_cli_plans_llama3_405b(capsys):
    P.main(
        [
            "--model",
            "llama3-405b",
            "--gpus",
            "8192",
            "--gpu",
            "h100-80gb",
            "--global-batch",
            "2048",
            "--tp",
            "8",
            "--pp",
            "16",
            "--recompute",
            "full",
            "--top",
            "2",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        "llama3-405b: 405,853,388,800 parameters, L=126 h=16384 a=128 kv=8 f=53248 untied "
    )
    # sdpa: the llama presets' default
    assert out[0].endswith("recompute full, SP, 1f1b, sdpa attention")
    assert out[2].split()[:5] == ["8", "16", "64", "1", "1"] and out[-1].startswith(
        "recommended: tp=8 pp=16 dp=64"
    )
    P.main(
        [
            "--model",
            "llama3-405b",
            "--gpus",
            "8192",
            "--gpu",
            "h100-80gb",
            "--global-batch",
            "2048",
            "--tp",
            "8",
            "--pp",
            "16",
            "--recompute",
            "full",
            "--attention",
            "eager",
            "--json",
        ]
    )
    import json

    assert json.loads(capsys.readouterr().out)["run"]["attention"] == "eager"
    with pytest.raises(SystemExit) as e:
        P.main(
            [
                "--model",
                "llama3-405b",
                "--gpus",
                "8192",
                "--tp",
                "8",
                "--pp",
                "16",
                "--schedule",
                "interleaved",
            ]
        )
    # the trainer's rule: 126 = 2 x 63
    assert "interleaved needs --pp x --chunks | 126 layers" in str(e.value)


def test_llama_layouts_tp_must_split_the_mlp_and_the_key_value_heads():
    run, gpu = C.Run(global_batch=8), C.GPUS["a100-80gb"]
    kv3 = C.Model(4, 96, 6, 256, 32, arch="llama", n_kv_head=3, ffn_hidden=256)
    # 3 kv heads over tp 2
    assert "one must divide the other" in layouts.layout_error(kv3, gpu, 8, 2, 1, 0, run)
    # 1 group on both ranks
    assert layouts.layout_error(replace_run(kv3, n_kv_head=1), gpu, 8, 2, 1, 0, run) is None
    assert "MLP width 101" in layouts.layout_error(
        replace_run(kv3, ffn_hidden=101), gpu, 8, 2, 1, 0, run
    )


@pytest.mark.parametrize(
    "argv,expect",
    [
        (
            ["--model", "gpt3-175b", "--gpus", "8", "--global-batch", "1536"],
            "smallest cluster that fits is 48 x a100-80gb (tp=8 pp=1 dp=6 zero=3",
        ),
        (
            ["--model", "gpt3-175b", "--gpus", "8"],
            "smallest cluster that fits is 56 x a100-80gb (tp=8 pp=7 dp=1 zero=0",
        ),
        (
            ["--model", "gpt3-175b", "--gpus", "8", "--seq", "1000000", "--recompute", "none"],
            "no cluster fits",
        ),
        (["--model", "gpt3-175b", "--gpus", "1000"], "do not split as tp x pp x dp"),
        (
            ["--model", "bloom-176b", "--gpus", "384", "--tp", "7", "--pp", "12"],
            "--tp 7 must divide the 8 GPUs of a node",
        ),
        (
            [
                "--model",
                "bloom-176b",
                "--gpus",
                "384",
                "--tp",
                "4",
                "--pp",
                "12",
                "--global-batch",
                "2050",
            ],
            "--global-batch 2050 is not a multiple of dp 8 x --micro-batch 1 = 8 "
            "(Megatron refuses it too): use 2048 or 2056",
        ),
        (
            ["--model", "bloom-176b", "--gpus", "384", "--tp", "4", "--pp", "12", "--zero", "2"],
            "--zero 2 with --pp 12",
        ),
        (
            ["--model", "bloom-176b", "--gpus", "384", "--tp", "4", "--pp", "12", "--dp", "4"],
            "--dp 4 x --tp 4 x --pp 12 != --gpus 384",
        ),
        (
            [
                "--model",
                "bloom-176b",
                "--gpus",
                "384",
                "--global-batch",
                "2048",
                "--micro-batch",
                "2",
                "--rampup",
                "200",
                "16",
                "1000",
            ],
            "--rampup 200 16 1000",
        ),
        (["--model", "gpt3-175b", "--gpus", "12"], "--gpus 12 must be at most one node"),
        (["--model", "gpt4", "--gpus", "8"], "--model 'gpt4' is unknown"),
        (["--layers", "2", "--gpus", "8"], "without --model give --hidden --heads --vocab --seq"),
        (["--model", "tiny", "--heads", "3", "--gpus", "8"], "--hidden a multiple of --heads"),
        (
            ["--model", "tiny", "--gpus", "8", "--global-batch", "7", "--micro-batch", "2"],
            "multiple of --micro-batch",
        ),
    ],
)
def test_cli_bad_input(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        P.main(argv)
    assert expect in str(e.value) and str(e.value).startswith("plan: ") and "\n" not in str(e.value)


def test_smallest_cluster_is_smallest():
    run = C.Run(global_batch=1536)
    gpus, best = layouts.smallest_cluster(GPT3, C.GPUS["a100-80gb"], run)
    assert best.fits and gpus == 48
    assert not any(
        e.fits for g in range(8, 48, 8) for e in layouts.plan(GPT3, C.GPUS["a100-80gb"], g, run)
    )


def test_stages_are_the_trainers_split_with_embedding_first_and_head_last():
    from nanomega import pp

    bloom = C.MODELS["bloom-176b"]
    layers = C.layers_per_stage(bloom, 12)
    assert layers == [len(pp.stage_layers(70, 12, r)) for r in range(12)] == [6] * 10 + [5] * 2
    counts = C.stage_params(bloom, 4, 12)
    wte = 250880 // 4 * 14336  # 250,880 is already a multiple of 128 x 4
    # + embedding LayerNorm, no positions
    assert counts[0] == 6 * F.layer_params(14336, 4) + wte + 2 * 14336
    # + ln_f and the head's copy
    assert counts[11] == 5 * F.layer_params(14336, 4) + wte + 2 * 14336
    assert C.layers_per_stage(bloom, 5, v=2) == [14] * 5  # interleaved: the rank's two chunks of 7
    # Llama 3's split: the embedding and the head take a layer's slot each, 128 slots on 16 ranks x
    # 8 chunks
    llama = C.MODELS["llama3-405b"]
    # the trainer's: extra layers to the front
    assert C.layers_per_stage(llama, 16) == [8] * 14 + [7] * 2
    assert C.layers_per_stage(llama, 16, 8, "llama3") == [7] + [8] * 14 + [7]
    assert pp.chunk_layers(128, 16, 0, 0, 8) == range(0, 1) and pp.chunk_layers(
        128, 16, 15, 7, 8
    ) == range(127, 128)
    # 1F1B: 8 slots a rank
    assert C.layers_per_stage(llama, 16, 1, "llama3") == [7] + [8] * 14 + [7]


def test_links_follow_the_trainers_rank_order():
    import torch

    gpu = C.GPUS["a100-80gb"]
    for gpus, tp, pp in [(16, 2, 2), (384, 4, 12), (64, 1, 2), (8, 2, 2), (32, 8, 1)]:
        dp = gpus // (tp * pp)
        grid = torch.arange(gpus).view(dp, pp, tp)  # dist.Grid's layout: rank (d, p, t)
        node = grid // gpu.per_node
        pp_inside = all(len(set(node[d, :, t].tolist())) == 1 for d in range(dp) for t in range(tp))
        # members of one dp group on its first node
        members = int((node[:, 0, 0] == node[0, 0, 0]).sum())
        pp_bw, dp_bw = CT.links(gpu, gpus, tp, pp)
        assert pp_bw == (gpu.intra_bw if pp_inside else gpu.inter_bw)
        dp_inside = len(set(node[:, 0, 0].tolist())) == 1
        assert dp_bw == (gpu.intra_bw if dp_inside else min(gpu.intra_bw, members * gpu.inter_bw))


def test_batch_ramp_up_time():
    # seq 8: 64,000 samples
    run = C.Run(global_batch=64, tokens=1000 * 64 * 8, rampup=(16, 16, 3000))
    steps = CT.train_seconds(lambda b: 1.0, run, 8)  # one second per step whatever the batch
    # batches 16, 32, 48 take 1000 samples each, then 61,000 samples at 64
    assert steps == pytest.approx(1000 / 16 + 1000 / 32 + 1000 / 48 + 61000 / 64)
    # time per sample fixed: no cost
    assert CT.train_seconds(lambda b: b / 64, run, 8) == pytest.approx(1000)
    assert CT.train_seconds(lambda b: 1.0, replace_run(run, rampup=None), 8) == 1000


def replace_run(run, **kw):
    from dataclasses import replace

    return replace(run, **kw)


def test_bloom_must_show_json(capsys):
    import json

    P.main(
        [
            "--model",
            "bloom-176b",
            "--gpus",
            "384",
            "--gpu",
            "a100-80gb",
            "--global-batch",
            "2048",
            "--tp",
            "4",
            "--pp",
            "12",
            "--zero",
            "1",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    (e,) = out["estimates"]
    assert (e["tp"], e["pp"], e["dp"], e["zero"]) == (4, 12, 8, 1) and e["fits"]
    assert e["layers_per_stage"] == [6] * 10 + [5] * 2 and e["micro_batches"] == 256
    gb = e["gb_per_gpu"]
    assert gb["total"] == pytest.approx(
        gb["params"] + gb["grads"] + gb["optim"] + gb["acts"], abs=0.01
    )
    assert gb["total"] <= e["usable_gb"] < 80 * 2**30 / 1e9
    assert 0 < e["mfu"] < 1 and e["tflops_per_gpu"] < 312 and e["step_s"] > 0 and e["days"] > 0


def test_pinned_ramp_up_must_be_multiples_of_dp_micro_batch():
    with pytest.raises(SystemExit) as e:
        P.main(
            [
                "--model",
                "bloom-176b",
                "--gpus",
                "384",
                "--tp",
                "4",
                "--pp",
                "6",
                "--global-batch",
                "2048",
                "--micro-batch",
                "2",
                "--rampup",
                "192",
                "16",
                "9765625",
            ]
        )
    assert "multiples of dp 16 x --micro-batch 2 = 32" in str(e.value)


def test_offload_moves_the_optimizer_state_off_the_gpu_and_adds_its_time():
    """ZeRO-Offload in the planner (issue 32): the optimizer bytes per GPU times (1 - F), and the
    step time plus formulas.offload_seconds of the rank's offloaded elements (gradients down,
    weights up over PCIe vs the CPU Adam's pass through host memory, the slower of the two); nothing
    else changes."""
    from dataclasses import replace
    from nanomega import formulas
    from nanomega.tools import cost, cost_time

    model, gpu = cost.MODELS["gpt3-175b"], cost.GPUS["a100-80gb"]
    base = cost.Run(zero=(1,))
    for share in (0.5, 1.0):
        run = replace(base, offload=share)
        a = cost_time.evaluate(model, gpu, 64, 4, 8, 1, base)
        b = cost_time.evaluate(model, gpu, 64, 4, 8, 1, run)
        assert b.optim == pytest.approx(a.optim * (1 - share)) and (b.params, b.grads, b.acts) == (
            a.params,
            a.grads,
            a.acts,
        )
        # the rank's optimizer elements: ZeRO-1 over dp 2
        n = -(-max(cost.stage_params(model, 4, 8)) // 2)
        extra = formulas.offload_seconds(share * n, 4, 2, gpu.pcie_bw, gpu.host_bw)
        # the host pass: 28 bytes of AdamW + the bf16 weights it writes for the upload (cpu_adam.py)
        assert b.step_s - a.step_s == pytest.approx(extra) and extra == pytest.approx(
            share * n * 30 / gpu.host_bw
        )


MIXTRAL = C.MODELS["mixtral-8x7b"]


def test_mixtral_8x7b_total_and_active_parameters():
    """Jiang et al. 2024 (Mixtral of Experts): 46.7B parameters, 12.9B active per token (2 of 8
    experts)."""
    from nanomega.tools import cost_moe

    total, active = cost_moe.params(MIXTRAL)
    assert total == pytest.approx(46.7e9, rel=0.01) and active == pytest.approx(12.9e9, rel=0.01)
    assert C.n_params(MIXTRAL) == total  # the header's count: every expert
    # active = the dense stand-in's parameters (a 2f-wide MLP) + the routers (E h per layer): 6
    # N_active FLOPs
    assert active == C.n_params(cost_moe.stand_in(MIXTRAL)) + 32 * 8 * 4096


def test_moe_planner_memory_dp_bytes_and_all_to_all():
    """Experts / ep per GPU (ZeRO-0: state x 1/ep; ZeRO-1: the optimizer state sharded over edp =
    dp/ep, so the same per GPU whatever ep); the all-to-all per step = m x layers x
    formulas.moe_all_to_all_bytes of uniform routing, on NVLink while an ep group fits in a node;
    ZeRO-3, offload and SP refused as the trainer does."""
    from nanomega.tools import cost_moe

    gpu, run = (
        C.GPUS["h100-80gb"],
        C.Run(global_batch=256, sp=False, attention="sdpa", zero=(0, 1, 2, 3)),
    )
    held = {ep: cost_moe.expert_state_bytes(MIXTRAL, 1, 4, 16, 0, ep=ep) for ep in (1, 8)}
    # 8 layers of 8 experts a stage, 18 B a parameter
    assert held[1] == 8 * held[8] == 8 * 8 * 3 * 4096 * 14336 * 18
    z1 = {ep: cost_moe.rank_state_bytes(MIXTRAL, 1, 4, 16, 1, ep=ep)[0] for ep in (1, 8)}
    # optimizer state the same; weights ~ 1/ep
    assert z1[1][2] == z1[8][2] and z1[8][0] < z1[1][0] / 4
    est = cost_moe.evaluate(MIXTRAL, gpu, 64, 1, 4, 1, run, ep=8)
    step, dp_b, a2a_b, a2a_s = cost_moe.step_seconds(MIXTRAL, gpu, 64, 1, 4, 1, run, ep=8)
    # micro-batches, rows sent per micro-batch and layer
    m, rows = 256 // 16, 7 / 8 * 2 * MIXTRAL.seq_len
    assert (
        a2a_b == m * 8 * (2 * 2 * rows * 4096 * 2 + 7 * 1 * 8)
        and est.step_s == step
        and est.dp_comm == dp_b
    )
    # an ep group: 8 ranks 4 apart (tp x pp = 4), 2 in a node: 6 of the 7 others' bytes leave it, 1
    # on NVLink
    assert a2a_s == pytest.approx(
        a2a_b / m * (m + 3) * (6 / 7 / gpu.inter_bw + 1 / 7 / gpu.intra_bw)
    )
    assert cost_moe.step_seconds(MIXTRAL, gpu, 64, 1, 4, 1, run, ep=1)[2:] == (0, 0.0)
    assert {e.zero for e in layouts.plan(MIXTRAL, gpu, 64, run, ep=8)} == {0, 1, 2}
    assert "--no-sp" in layouts.layout_error(MIXTRAL, gpu, 64, 2, 1, 1, C.Run(sp=True), ep=8)


def test_cli_plans_mixtral_with_expert_parallelism(capsys):
    P.main(
        [
            "--model",
            "mixtral-8x7b",
            "--gpus",
            "64",
            "--gpu",
            "h100-80gb",
            "--ep",
            "8",
            "--seq",
            "4096",
            "--global-batch",
            "1024",
            "--top",
            "2",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mixtral-8x7b: 46,702,792,704 parameters") and ", SP" not in out[0]
    assert out[-1].startswith(
        "experts: 8 per layer, top-2: 12,879,925,248 of 46,702,792,704 parameters active"
    )
    assert "ep 8: 1 per GPU and layer" in out[-1]
    with pytest.raises(SystemExit) as e:
        P.main(["--model", "mixtral-8x7b", "--gpus", "64", "--ep", "3", "--tp", "1", "--pp", "1"])
    assert (
        str(e.value) == "plan: --ep 3 must divide --n-experts 8 and dp 64 (ep is carved out of dp)"
    )
    with pytest.raises(SystemExit, match="needs a Llama model"):
        P.main(["--model", "gpt3-175b", "--gpus", "64", "--n-experts", "8"])
