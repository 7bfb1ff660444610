"""Lesson 11 experiment: bytes autograd saves per layer with no, selective and full recompute
(counted with saved_tensors_hooks) next to sbh(34 + 5as/h), and the FLOPs each mode adds
(FlopCounterMode).
Step times and peak memory: bench/bench_precision_recompute.py."""

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

from check import check
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import cast_model
from nanomega.formulas import activation_bytes_per_layer
from nanomega.recompute import apply_recompute, saved_bytes_per_layer

s, b, h, a, L, V = 256, 2, 64, 4, 2, 256
torch.manual_seed(0)
base = GPT(GPTConfig(vocab_size=V, block_size=s, n_layer=L, n_head=a, n_embd=h, dropout=0.1))
x = torch.randint(0, V, (b, s))
MODES = ("none", "selective", "full")

# 1. the paper's count (2-byte activations, 1-byte dropout masks, 2-byte softmax output)
sbh = s * b * h
print(f"s={s} b={b} h={h} a={a}: sbh = {sbh:,}, 5as/h = {5 * a * s / h:g}")
for mode in MODES:
    paper = activation_bytes_per_layer(s, b, h, a, recompute=mode)
    print(f"paper, {mode:>9}: {paper:>10,.0f} bytes per layer = {paper / sbh:g} sbh")

# 2. measured per layer, bf16 model on CPU: masks are kept in bf16 (2 B), the softmax output in fp32
# (4 B)
model = cast_model(copy.deepcopy(base), torch.bfloat16)
for mode in MODES:
    apply_recompute(model, mode)
    measured = saved_bytes_per_layer(model, lambda: model(x, x))["0"]
    check(
        f"bf16 saved bytes per layer, {mode}",
        measured,
        activation_bytes_per_layer(s, b, h, a, recompute=mode, act=2, mask=2, probs=4),
        rtol=0.1,
    )
apply_recompute(model, "full", 1)  # only the first layer
print(
    "full recompute of the first 1 layer, per layer:",
    saved_bytes_per_layer(model, lambda: model(x, x)),
)

# 3. the compute price in matmul FLOPs of one step: forward 24bsh^2 + 4bs^2h per layer, backward 2x
fwd = 24 * b * s * h * h + 4 * b * s * s * h
step = 3 * (L * fwd + 2 * b * s * h * V)  # + the LM head
extra = {"none": 0, "selective": L * 2 * b * s * s * h, "full": L * fwd}
for mode in MODES:
    m = apply_recompute(copy.deepcopy(base), mode)
    with FlopCounterMode(display=False) as counter:
        m(x, x).backward()
    check(f"FLOPs of one step, {mode}", counter.get_total_flops(), step + extra[mode])
