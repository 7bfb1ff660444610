"""The planner's formulas against published figures, the dense model, and hand counts; the CLI end to end."""
import pytest

from nanomega import formulas as F
from nanomega.tools import cost as C, plan as P
from nanomega.model import GPT, GPTConfig
from nanomega.formulas import model_flops_per_token

GPT3 = C.MODELS["gpt3-175b"]


def test_zero_paper_figure_1():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, fp16 params and grads + K=12 Adam state
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
    p, g, o = F.zero_state_bytes(10, 3, 4, 1, 1, 1)  # 10 elements over 4 ranks: the largest shard has 3
    assert (p, g, o) == (3, 3, 3)
    totals = [sum(F.zero_state_bytes(1000, s, 8)) for s in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_dp_comm_bytes():
    n, d, B = 1000, 8, 2
    ar = F.dp_comm_bytes(n, 0, d, B)
    assert ar == 2 * (d - 1) / d * n * B  # ring all-reduce
    assert F.dp_comm_bytes(n, 1, d, B) == F.dp_comm_bytes(n, 2, d, B) == ar  # reduce-scatter + all-gather
    assert F.dp_comm_bytes(n, 3, d, B) == 1.5 * ar  # + a second all-gather in backward
    assert F.dp_comm_bytes(n, 0, 1, B) == 0
    # grads reduced in fp32, params gathered in bf16; with 4 micro-batches stage 2 reduces each one, 3 also gathers
    f = (d - 1) / d * n
    assert F.dp_comm_bytes(n, 1, d, 4, 2, micro_batches=4) == f * 4 + f * 2
    assert F.dp_comm_bytes(n, 2, d, 4, 2, micro_batches=4) == 4 * f * 4 + f * 2
    assert F.dp_comm_bytes(n, 3, d, 4, 2, micro_batches=4) == 4 * f * 4 + 8 * f * 2


def test_tp_and_pp_comm_bytes():
    b, s, h, t = 2, 16, 64, 4
    ar = 2 * (t - 1) / t * b * s * h * 2  # one ring all-reduce of (b, s, h) in 2-byte elements
    assert F.tp_comm_bytes_per_layer(b, s, h, t, 2) == 4 * ar
    # SP: RS + AG carry an all-reduce's bytes, + 2 backward re-gathers of the stored shards: 10 (t-1)/t bsh B,
    # what lesson 04 measures (tp=2 and 4) against TP's 8 (t-1)/t
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
    assert coef(t=1, sp=False) == coef(t=1, sp=True)  # both forms reduce to the unparallel one at t=1
    # the paper's headline numbers: selective saves 70% (GPT-3) and 65% (MT-NLG, 5as/h = 64); ~5x overall
    assert 1 - coef(sp=True, recompute="selective") / coef(sp=True) == pytest.approx(0.70, abs=0.005)
    assert 1 - 34 / (34 + 5 * 128 * 2048 / 20480) == pytest.approx(0.65, abs=0.005)
    m = C.MODELS["mt-nlg-530b"]
    ratio = (F.activation_bytes_per_layer(s, b, m.n_embd, m.n_head, 8)
             / F.activation_bytes_per_layer(s, b, m.n_embd, m.n_head, 8, True, "selective"))
    assert ratio == pytest.approx(5, rel=0.02)


def test_pipeline_bubble_and_inflight():
    # unit clock, forward = backward = 1 tick: 1F1B takes 2(m + p - 1) ticks, each stage idles 2(p - 1)
    p, m = 4, 8
    assert F.pipeline_bubble(p, m) == 2 * (p - 1) / (2 * (m + p - 1)) == 3 / 11
    assert F.pipeline_bubble(p, m, v=2) == (p - 1) / (2 * m + p - 1)
    assert F.pipeline_bubble(1, m) == 0
    assert 1 / (1 - F.pipeline_bubble(p, m, 2)) == pytest.approx(1 + (p - 1) / (2 * m))
    assert F.inflight_microbatches(p, m, "gpipe") == m
    assert F.inflight_microbatches(p, m, "1f1b") == p and F.inflight_microbatches(p, 2, "1f1b") == 2
    # interleaved: Korthikanti's L(1 + (p-1)/(p v)) layers = (p + (p-1)/v) stages' worth
    assert F.inflight_microbatches(p, m, "interleaved", 3) * (96 / p) == pytest.approx(96 * (1 + (p - 1) / (p * 3)))
    assert F.inflight_microbatches(1, m, "gpipe") == 1


@pytest.mark.parametrize("kw", [dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64),
                                dict(vocab_size=300, block_size=32, n_layer=3, n_head=2, n_embd=32, alibi=True,
                                     embed_layernorm=True)])
def test_parameter_and_flop_counts_match_the_dense_model(kw):
    cfg = GPTConfig(**kw)
    model = C.Model.from_shape(vars(cfg))  # the planner's Model is GPTConfig's shape (model.SHAPE_KEYS)
    assert C.n_params(model) == sum(p.numel() for p in GPT(cfg).parameters())  # tied head counted once
    n = C.n_params(model) - (0 if cfg.alibi else cfg.block_size * cfg.n_embd)
    assert F.flops_per_token(n, cfg.n_layer, cfg.n_embd, cfg.block_size) == model_flops_per_token(cfg)


def test_tensor_and_pipeline_parameter_shards():
    h, t = 64, 4  # by hand: qkv (3h/t x h) + 3h/t, proj (h x h/t) + h, fc (4h/t x h) + 4h/t, proj (h x 4h/t) + h, 2 LN
    assert F.layer_params(h, t) == 3 * h * h // t + 3 * h // t + h * h // t + h + 4 * h * h // t + 4 * h // t \
        + h * 4 * h // t + h + 4 * h
    tiny = C.Model(4, 64, 4, 300, 32)
    wte = 512 // 2 * 64  # 300 padded to a multiple of 128 * tp = 256 -> 512, split over tp = 2
    first, last = C.stage_params(tiny, tp=2, pp=2)
    assert first == 2 * F.layer_params(64, 2) + wte + 32 * 64
    assert last == 2 * F.layer_params(64, 2) + 2 * 64 + wte  # ln_f and the head's own copy of wte
    assert C.n_params(C.MODELS["gpt2-124m"]) == 124_475_904  # nanoGPT's 123.69M + 786,432 positions


def test_gpt3_and_opt_compute():
    # GPT-3 paper Table D.1: 3.14e23 training FLOPs for 175B on 300B tokens; 6ND with N = 175e9 is 3.15e23
    assert 6 * 175e9 * 300e9 == pytest.approx(3.15e23)
    n = C.n_params(GPT3) - 2048 * 12288
    assert 6 * n * 300e9 == pytest.approx(3.14e23, rel=0.005)
    # OPT-175B: 992 A100s, ~33 days (model card); 300B tokens -> MFU ~36%; counting the recompute forward (8ND)
    # gives the hardware utilisation OPT reports, 147 TFLOP/s per GPU = 47% of 312
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
    ests = P.plan(GPT3, C.GPUS["a100-80gb"], 1024, run)
    fit = [e for e in ests if e.fits]
    assert fit and len(fit) < len(ests)
    assert all(e.memory <= 0.9 * 80 * 2**30 for e in fit) and all(e.memory > 0.9 * 80 * 2**30 for e in ests[len(fit):])
    assert [e.step_s for e in fit] == sorted(e.step_s for e in fit)
    assert all(e.tp * e.pp * e.dp == 1024 and 1536 % e.dp == 0 for e in ests)
    assert not any(e.zero >= 2 and e.pp > 1 for e in ests)  # DeepSpeed refuses ZeRO-2/3 with pipelines
    best = fit[0]
    assert (best.tp, best.pp, best.dp, best.zero) == (8, 8, 16, 1)
    assert 0.3 < best.mfu < 0.6 and best.tflops < best.mfu * 312e12 * 1.2  # recompute: hardware > model FLOPs
    assert best.tp_comm == 96 * (96 // 8) * F.tp_comm_bytes_per_layer(1, 2048, 12288, 8, 2, True, "selective")
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
    P.main(["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "64", "--gpus", "4",
            "--global-batch", "8"])
    out = capsys.readouterr().out
    assert "220,544 parameters" in out and "MB/GPU" in out


@pytest.mark.parametrize("argv,expect", [
    (["--model", "gpt3-175b", "--gpus", "8", "--global-batch", "1536"],
     "smallest cluster that fits is 48 x a100-80gb (tp=8 pp=1 dp=6 zero=3"),
    (["--model", "gpt3-175b", "--gpus", "8"], "smallest cluster that fits is 56 x a100-80gb (tp=8 pp=7 dp=1 zero=0"),
    (["--model", "gpt3-175b", "--gpus", "8", "--seq", "1000000", "--recompute", "none"], "no cluster fits"),
    (["--model", "gpt3-175b", "--gpus", "1000"], "do not split as tp x pp x dp"),
    (["--model", "bloom-176b", "--gpus", "384", "--tp", "7", "--pp", "12"], "--tp 7 must divide the 8 GPUs of a node"),
    (["--model", "bloom-176b", "--gpus", "384", "--tp", "4", "--pp", "12", "--global-batch", "2050"],
     "--global-batch 2050 is not a multiple of dp 8 x --micro-batch 1 = 8 (Megatron refuses it too): use 2048 or 2056"),
    (["--model", "bloom-176b", "--gpus", "384", "--tp", "4", "--pp", "12", "--zero", "2"], "--zero 2 with --pp 12"),
    (["--model", "bloom-176b", "--gpus", "384", "--tp", "4", "--pp", "12", "--dp", "4"], "--dp 4 x --tp 4 x --pp 12 != --gpus 384"),
    (["--model", "bloom-176b", "--gpus", "384", "--global-batch", "2048", "--micro-batch", "2", "--rampup", "200", "16", "1000"],
     "--rampup 200 16 1000"),
    (["--model", "gpt3-175b", "--gpus", "12"], "--gpus 12 must be at most one node"),
    (["--model", "gpt4", "--gpus", "8"], "--model 'gpt4' is unknown"),
    (["--layers", "2", "--gpus", "8"], "without --model give --hidden --heads --vocab --seq"),
    (["--model", "tiny", "--heads", "3", "--gpus", "8"], "--hidden a multiple of --heads"),
    (["--model", "tiny", "--gpus", "8", "--global-batch", "7", "--micro-batch", "2"], "multiple of --micro-batch"),
])
def test_cli_bad_input(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        P.main(argv)
    assert expect in str(e.value) and str(e.value).startswith("plan: ") and "\n" not in str(e.value)


def test_smallest_cluster_is_smallest():
    run = C.Run(global_batch=1536)
    gpus, best = P.smallest_cluster(GPT3, C.GPUS["a100-80gb"], run)
    assert best.fits and gpus == 48
    assert not any(e.fits for g in range(8, 48, 8) for e in P.plan(GPT3, C.GPUS["a100-80gb"], g, run))


def test_stages_are_the_trainers_split_with_embedding_first_and_head_last():
    from nanomega import pp
    bloom = C.MODELS["bloom-176b"]
    layers = C.layers_per_stage(bloom, 12)
    assert layers == [len(pp.stage_layers(70, 12, r)) for r in range(12)] == [6] * 10 + [5] * 2
    counts = C.stage_params(bloom, 4, 12)
    wte = 250880 // 4 * 14336  # 250,880 is already a multiple of 128 x 4
    assert counts[0] == 6 * F.layer_params(14336, 4) + wte + 2 * 14336  # + embedding LayerNorm, no positions
    assert counts[11] == 5 * F.layer_params(14336, 4) + wte + 2 * 14336  # + ln_f and the head's copy
    assert C.layers_per_stage(bloom, 5, v=2) == [14] * 5  # interleaved: the rank's two chunks of 7


def test_links_follow_the_trainers_rank_order():
    import torch
    gpu = C.GPUS["a100-80gb"]
    for gpus, tp, pp in [(16, 2, 2), (384, 4, 12), (64, 1, 2), (8, 2, 2), (32, 8, 1)]:
        dp = gpus // (tp * pp)
        grid = torch.arange(gpus).view(dp, pp, tp)  # dist.Grid's layout: rank (d, p, t)
        node = grid // gpu.per_node
        pp_inside = all(len(set(node[d, :, t].tolist())) == 1 for d in range(dp) for t in range(tp))
        members = int((node[:, 0, 0] == node[0, 0, 0]).sum())  # members of one dp group on its first node
        pp_bw, dp_bw = C.links(gpu, gpus, tp, pp)
        assert pp_bw == (gpu.intra_bw if pp_inside else gpu.inter_bw)
        dp_inside = len(set(node[:, 0, 0].tolist())) == 1
        assert dp_bw == (gpu.intra_bw if dp_inside else min(gpu.intra_bw, members * gpu.inter_bw))


def test_batch_ramp_up_time():
    run = C.Run(global_batch=64, tokens=1000 * 64 * 8, rampup=(16, 16, 3000))  # seq 8: 64,000 samples
    steps = C.train_seconds(lambda b: 1.0, run, 8)  # one second per step whatever the batch
    # batches 16, 32, 48 take 1000 samples each, then 61,000 samples at 64
    assert steps == pytest.approx(1000 / 16 + 1000 / 32 + 1000 / 48 + 61000 / 64)
    assert C.train_seconds(lambda b: b / 64, run, 8) == pytest.approx(1000)  # time per sample fixed: no cost
    assert C.train_seconds(lambda b: 1.0, replace_run(run, rampup=None), 8) == 1000


def replace_run(run, **kw):
    from dataclasses import replace
    return replace(run, **kw)


def test_bloom_must_show_json(capsys):
    import json
    P.main(["--model", "bloom-176b", "--gpus", "384", "--gpu", "a100-80gb", "--global-batch", "2048", "--tp", "4",
            "--pp", "12", "--zero", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    (e,) = out["estimates"]
    assert (e["tp"], e["pp"], e["dp"], e["zero"]) == (4, 12, 8, 1) and e["fits"]
    assert e["layers_per_stage"] == [6] * 10 + [5] * 2 and e["micro_batches"] == 256
    gb = e["gb_per_gpu"]
    assert gb["total"] == pytest.approx(gb["params"] + gb["grads"] + gb["optim"] + gb["acts"], abs=0.01)
    assert gb["total"] <= e["usable_gb"] < 80 * 2**30 / 1e9
    assert 0 < e["mfu"] < 1 and e["tflops_per_gpu"] < 312 and e["step_s"] > 0 and e["days"] > 0


def test_pinned_ramp_up_must_be_multiples_of_dp_micro_batch():
    with pytest.raises(SystemExit) as e:
        P.main(["--model", "bloom-176b", "--gpus", "384", "--tp", "4", "--pp", "6", "--global-batch", "2048",
                "--micro-batch", "2", "--rampup", "192", "16", "9765625"])
    assert "multiples of dp 16 x --micro-batch 2 = 32" in str(e.value)
