"""Lesson 01 experiment: count the model's FLOPs with PyTorch, compare with 6N' + 12Lhs; loss at
init; MFU."""

import math
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from check import check
from nanomega.formulas import model_flops_per_token as flops_per_token
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.job import meter

torch.manual_seed(0)
cfg = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=128)
model = GPT(cfg)
b, s = 4, cfg.block_size
x, y = torch.randint(0, cfg.vocab_size, (b, s)), torch.randint(0, cfg.vocab_size, (b, s))

# 1. parameters: 12 L h^2 + 13 L h per layer stack, V h tied embedding, s h positions, 2h final
# LayerNorm
L, h, V = cfg.n_layer, cfg.n_embd, cfg.padded_vocab_size
check(
    "parameters",
    sum(p.numel() for p in model.parameters()),
    L * (12 * h * h + 13 * h) + V * h + s * h + 2 * h,
)

# 2. FLOPs of one forward+backward, counted op by op by PyTorch (matmuls only), per token
with FlopCounterMode(display=False) as counter:
    model(x, y).backward()
counted = counter.get_total_flops() / (b * s)
n_mat = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "wpe" not in name)
check("FLOPs per token, counted vs 6 N_matrices + 12Lhs", counted, 6 * n_mat + 12 * L * h * s)
# flops_per_token() also counts biases and LayerNorms in N' (the 6N rule does): 0.5% more here
check("FLOPs per token, counted vs flops_per_token()", counted, flops_per_token(cfg), rtol=0.01)

# 3. at initialisation every token is about equally likely: loss ~ ln(V)
check("loss at init vs ln(V)", model(x, y).item(), math.log(V), rtol=0.02)

# 4. MFU of a few training steps on this machine (a timing: printed, never asserted)
peak, _ = meter.peak_flops("cpu", torch.float32)  # best of many matmuls over >= 1 s
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
t0 = time.perf_counter()
for _ in range(5):
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
tok_s = 5 * b * s / (time.perf_counter() - t0)
print(
    f"measured: {tok_s:,.0f} tokens/s x {flops_per_token(cfg) / 1e6:.2f} MFLOP/token "
    f"/ {peak / 1e9:.0f} GFLOP/s peak = MFU {100 * tok_s * flops_per_token(cfg) / peak:.0f}%"
)
