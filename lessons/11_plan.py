"""Lesson 11: plan a run no machine here can do, and check the planner against published figures.

Each `check` prints the planner's value ("measured") next to the published figure ("formula"), with a
tolerance for the paper's rounding. Run from the repository root: python lessons/11_plan.py
"""
from check import check

from nanomega import plan as P, plan_formulas as F

print("== ZeRO (Rajbhandari et al. 2020, Fig. 1): 7.5B parameters, 64 GPUs, fp16 + Adam (2 + 2 + K=12 bytes)")
for stage, published in enumerate([120, 31.4, 16.6, 1.9]):
    gb = sum(F.zero_state_bytes(7.5e9, stage, 64, 2, 2, 12)) / 1e9
    check(f"ZeRO-{stage} model state per GPU", gb, published, atol=0.05, unit=" GB")

print("== Megatron distributed optimizer: bf16 parameters, fp32 gradients, 18 bytes per parameter -> 6 + 12/d")
n = 3 * 2**26  # divisible by every d below, so no shard is padded
for d in (1, 8, 64):
    check(f"bytes per parameter, d={d}", sum(F.zero_state_bytes(n, 1, d, *P.PRECISIONS["bf16"])) / n, 6 + 12 / d)

print("== GPT-3 175B on 300B tokens")
gpt3 = P.MODELS["gpt3-175b"]
N = P.n_params(gpt3) - gpt3.seq_len * gpt3.n_embd  # matmul parameters (positions are a lookup)
print(f"N = {N:,} (96 layers of 12h^2 + 13h, and the tied 50304 x 12288 vocabulary matrix)")
print(f"6 x 175e9 x 300e9 = {6 * 175e9 * 300e9:.3g} FLOPs; with the attention term 6N + 12Lhs: "
      f"{F.flops_per_token(N, 96, 12288, 2048) * 300e9:.3g}")
check("GPT-3 training FLOPs 6ND (paper, Table D.1)", 6 * N * 300e9, 3.14e23, rtol=0.005)
days = 8 * N * 300e9 / (1024 * 140e12) / 86400  # Narayanan et al. 2021, eq. 4: full recompute, 140 TFLOP/s/GPU
check("GPT-3 on 1024 A100s at 140 TFLOP/s, days (Narayanan et al.)", days, 34, atol=0.5, unit=" days")

print("== OPT-175B: 992 A100-80GB, ~33 days of continuous training (model card), 300B tokens")
opt = P.n_params(P.MODELS["opt-175b"]) - 2048 * 12288
mfu = F.implied_mfu(6 * opt * 300e9, 33, 992, 312e12)
print(f"implied MFU = 6ND / (33 days x 992 x 312 TFLOP/s) = {mfu:.1%}")
check("OPT-175B implied hardware FLOP/s, 8ND (paper: 147 TFLOP/s)", mfu * 8 / 6 * 312, 147, rtol=0.02,
      unit=" TFLOP/s")

print("== Korthikanti et al. 2022: activation bytes per layer, GPT-3 175B (s=2048, b=1, h=12288, a=96, t=8)")
s, b, h, a, t = 2048, 1, 12288, 96, 8
sbh, r = s * b * h, 5 * a * s / h
check("5as/h for GPT-3", r, 80)
for name, kw, published in [("no parallelism: 34 + 5as/h", {}, 34 + r),
                            ("TP: 10 + 24/t + 5as/(ht)", dict(t=t), 10 + 24 / t + r / t),
                            ("TP+SP: (34 + 5as/h)/t", dict(t=t, sp=True), (34 + r) / t),
                            ("TP+SP+selective: 34/t", dict(t=t, sp=True, recompute="selective"), 34 / t),
                            ("full recompute: 2", dict(t=t, recompute="full"), 2)]:
    per_layer = F.activation_bytes_per_layer(s, b, h, a, **kw)
    check(f"sbh x [{name}]", per_layer / sbh, published)
    print(f"    = {per_layer / 1e9:.3f} GB per layer per sequence, {96 * per_layer / 1e9:.1f} GB for 96 layers")
act = lambda model, **kw: F.activation_bytes_per_layer(s, b, model.n_embd, model.n_head, **kw)
for name, model, published in [("GPT-3", gpt3, 0.70), ("MT-NLG 530B", P.MODELS["mt-nlg-530b"], 0.65)]:
    saved = 1 - act(model, t=t, sp=True, recompute="selective") / act(model, t=t, sp=True)
    check(f"selective recompute saves, {name} (paper: {published:.0%})", saved, published, atol=0.005)
mtnlg = P.MODELS["mt-nlg-530b"]
ratio = act(mtnlg, t=t) / act(mtnlg, t=t, sp=True, recompute="selective")
check("TP -> TP+SP+selective, MT-NLG 530B (paper: 5x)", ratio, 5, rtol=0.02, unit="x")

print("== Plan: GPT-3 175B on 1024 A100-80GB, global batch 1536 x 2048, 300B tokens")
P.main(["--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb", "--global-batch", "1536", "--top", "5"])
h100 = P.plan(gpt3, P.GPUS["h100-80gb"], 1024, P.Run(global_batch=1536))[0]
print(f"same on 1024 H100s: {P.describe(h100)}, step {h100.step_s:.1f} s, MFU {h100.mfu:.1%}, {h100.days:.1f} days")

print("== Bad input: GPT-3 175B on one node")
try:
    P.main(["--model", "gpt3-175b", "--gpus", "8", "--global-batch", "1536"])
except SystemExit as e:
    print(e)
