"""Lesson 09 experiment: the three formats' ranges, bytes per parameter in mixed precision (counted
from the ZeRO engine's real tensors), a real fp16 overflow in attention and the sqrt(n) trick that
avoids it, and what fp16 does to small gradients with and without loss scaling."""

import copy

import torch

from check import check
from nanomega import dist
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import DTYPES, cast_model, check_dtype_supported
from nanomega.zero import ZeroEngine

torch.manual_seed(0)
NAME = {dtype: name for name, dtype in DTYPES.items()}

# 1. ranges, from the bit layout: max = (2 - 2^-mantissa) * 2^(2^(exponent-1) - 1), eps =
# 2^-mantissa
for name, dtype, exp_bits, man_bits in (
    ("fp16", torch.float16, 5, 10),
    ("bf16", torch.bfloat16, 8, 7),
):
    fi, bias = torch.finfo(dtype), 2 ** (exp_bits - 1) - 1
    check(f"{name} max", fi.max, (2 - 2.0**-man_bits) * 2.0**bias)
    check(f"{name} smallest normal", fi.tiny, 2.0 ** (1 - bias))
    check(f"{name} eps (1 ulp at 1.0)", fi.eps, 2.0**-man_bits)
for dtype in (torch.bfloat16, torch.float16):
    check_dtype_supported(dtype, "cpu")  # raises where the device lacks the kernels
print("fp16 and bf16 matmul + backward both run on this CPU (torch", torch.__version__ + ")")

# 2. bytes per parameter: a bf16 model under the engine (a world of one), after one AdamW step
dist.init("cpu")
grid = dist.Grid(1, 1, 1)
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
base = GPT(cfg)
x = torch.randint(0, 256, (2, 32))
for grad_dtype, formula in ((torch.bfloat16, 16), (torch.float32, 18)):
    model = cast_model(copy.deepcopy(base), torch.bfloat16)
    engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), grid, grad_dtype=grad_dtype)
    model(x, x).backward()
    engine.step()
    mem, n = engine.memory_bytes(), sum(p.numel() for p in model.parameters())
    steps = 4 * len(engine.pieces)  # AdamW's one fp32 step counter per tensor: not per parameter
    per_param = (sum(mem.values()) - steps) / n
    print(
        f"bf16 weights {mem['params'] / n:.0f} B + {NAME[grad_dtype]} grads {mem['grads'] / n:.0f} B + "
        f"fp32 master, m, v {(mem['optimizer'] - steps) / n:.0f} B per parameter"
    )
    check(f"bytes per parameter, {NAME[grad_dtype]} gradients", per_param, formula)

# 3. a real fp16 overflow: q.k over head_dim 64 with activations of 40 (outliers this large are
# common)
b, nh, s, d = 1, 2, 8, 64
attn = model.blocks["0"].attn
q = k = v = torch.full((b, nh, s, d), 40.0)
for dtype in (torch.float16, torch.bfloat16):
    scores = q.to(dtype) @ k.to(dtype).transpose(-2, -1)  # each entry 64 * 1600 = 102,400 > 65,504
    # scaled after the product
    late = torch.softmax(scores.float() / d**0.5, -1).to(dtype) @ v.to(dtype)
    # the eager core scales q first in 16 bits
    out = attn.core(q.to(dtype), k.to(dtype), v.to(dtype))
    check(
        f"{NAME[dtype]} QK^T entries that overflow",
        int((~scores.isfinite()).sum()),
        b * nh * s * s if dtype == torch.float16 else 0,
    )
    check(
        f"{NAME[dtype]} attention outputs that are nan, scaled after q k^T",
        int(late.isnan().sum()),
        b * nh * s * d if dtype == torch.float16 else 0,
    )
    check(
        f"{NAME[dtype]} attention outputs that are nan, q scaled first (core)",
        int(out.isnan().sum()),
        0,
    )
# the trick: n (A B) = (sqrt(n) A)(sqrt(n) B) with n = 1/sqrt(d): scale both factors before the
# matmul
root = d**-0.25
scaled = (q.half() * root) @ (k.half() * root).transpose(-2, -1)
check(
    "fp16 (d^-1/4 q)(d^-1/4 k)^T = q k^T / sqrt(d)",
    scaled.float().max().item(),
    40.0 * 40.0 * d / d**0.5,
)

# 4. small gradients: fp16 flushes what is below 2^-24 to zero; loss scaling lifts them into range
ref = copy.deepcopy(base)
x = torch.randint(0, 256, (8, 32))
ref(x, x).backward()
g32 = torch.cat([p.grad.flatten() for p in ref.parameters()])
print(
    f"fp32 gradient entries below fp16's smallest normal 2^-14: {(g32.abs() < 2**-14).float().mean():.1%}"
)
for scale in (1.0, 2.0**16):
    half = cast_model(copy.deepcopy(base), torch.float16)
    (half(x, x) * scale).backward()
    g16 = torch.cat([p.grad.flatten().float() / scale for p in half.parameters()])
    print(
        f"fp16 backward, loss scale {scale:>7g}: {int(((g16 == 0) & (g32 != 0)).sum())} of "
        f"{int((g32 != 0).sum())} gradient entries flushed to zero, {int((~g16.isfinite()).sum())} inf, "
        f"relative error {((g16 - g32).norm() / g32.norm()).item():.1e}"
    )
torch.distributed.destroy_process_group()
