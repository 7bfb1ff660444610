"""Lesson 13: the modern block -- what Llama's four changes to GPT-2's block buy, counted and
measured on a CPU."""

import math
import os
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import formulas  # noqa: E402
from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.modern import Rotary, ffn_hidden, rms_norm  # noqa: E402
from nanomega.job.presets import PRESETS  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)


def block_params(cfg):
    with torch.device("meta"):  # shapes only: a 405B block costs nothing to count
        return sum(p.numel() for p in GPT(cfg).blocks["0"].parameters())


# 1. SwiGLU's width and the parameters of one block: Llama keeps GPT-2's 8h^2 MLP with three
# matrices
h, a = 4096, 32
print(
    f"SwiGLU width for h = {h}: f = ffn_hidden(h) = {ffn_hidden(h)} (2/3 x 4h = {8 * h // 3}, up to a multiple of "
    f"256): 3hf = {3 * ffn_hidden(h) / h:.2f} h^2, GPT-2's MLP 8 h^2"
)
gpt2 = GPTConfig(n_layer=1, n_head=a, n_embd=h)
mha = GPTConfig(n_layer=1, n_head=a, n_embd=h, arch="llama")
gqa = GPTConfig(n_layer=1, n_head=a, n_embd=h, arch="llama", n_kv_head=8)
check("GPT-2 block parameters vs 12h^2 + 13h", block_params(gpt2), formulas.layer_params(h))
check(
    "Llama block, 32 kv heads, vs formula",
    block_params(mha),
    formulas.llama_layer_params(h, mha.ffn, a, a),
)
check(
    "Llama block, 8 kv heads, vs formula",
    block_params(gqa),
    formulas.llama_layer_params(h, gqa.ffn, a, 8),
)
for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
    cfg = GPTConfig(**PRESETS[name], make_vocab_size_divisible_by=1)
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    formula = (
        cfg.n_layer * formulas.llama_layer_params(cfg.n_embd, cfg.ffn, cfg.n_head, cfg.kv_heads)
        + 2 * cfg.vocab_size * cfg.n_embd
        + cfg.n_embd
    )  # untied: embedding and head; the final RMSNorm
    check(f"{name} parameters, counted on meta vs formula", n, formula)

# 2. GQA: the keys and values one token leaves behind (the KV cache at inference, k and v saved in
# training)
for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
    cfg = GPTConfig(**PRESETS[name])
    kv = 2 * cfg.n_layer * cfg.kv_heads * (cfg.n_embd // cfg.n_head) * 2  # k and v, bf16
    print(
        f"{name}: k and v per token {kv / 2**10:,.0f} KiB with {cfg.kv_heads} kv heads, "
        f"{2 * cfg.n_layer * cfg.n_embd * 2 / 2**10:,.0f} KiB with {cfg.n_head} (multi-head): "
        f"{cfg.n_head // cfg.kv_heads}x less"
    )

# 3. RoPE: the score of q at position i and k at position j depends on i - j only
hd, s = 64, 48
rot = Rotary(hd, theta=10000.0)
q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
scores = rot(q.expand(1, 1, s, hd)) @ rot(k.expand(1, 1, s, hd)).transpose(
    -1, -2
)  # (1, 1, s, s): same q, k
spread = max((d := scores[0, 0].diagonal(-off)).max() - d.min() for off in range(s)).item()
# the tables are fp32: angle i * theta_j is off by <= s * 2^-24 rad, so a score by <= |q| |k| s
# 2^-24 per pair sum
bound = q.norm().item() * k.norm().item() * s * 2**-24 * 2
print(
    f"RoPE: q.k over positions with the same i - j spreads by {spread:.2g} (the fp32 tables' bound: {bound:.2g})"
)
check("RoPE: q.k depends on i - j only, within the bound", int(spread <= bound), 1)
table = torch.randn(s, hd, dtype=torch.float64) * 0.5  # learned positions added to q and k instead
learned = (q + table) @ (k + table).T
print(
    f"learned positions instead: spread {max((d := learned.diagonal(-o)).max() - d.min() for o in range(s)):.2f} "
    f"(the model must learn that relative distance matters; RoPE builds it in)"
)

# 4. FLOPs: 6N + 12Lhs still holds (GQA changes N, not the attention matmuls), counted by PyTorch
cfg = GPTConfig(
    vocab_size=512,
    block_size=64,
    n_layer=2,
    n_head=8,
    n_kv_head=2,
    n_embd=128,
    arch="llama",
    attention="eager",
    tie_embeddings=False,
)
model = GPT(cfg, seed=0)
b = 2
x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
with FlopCounterMode(display=False) as counter:
    model(x, x).backward()
counted = counter.get_total_flops() / (b * cfg.block_size)
n_mat = sum(
    p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n
)  # lookup: no matmul
check(
    "FLOPs per token, counted vs 6 N_matrices + 12Lhs",
    counted,
    6 * n_mat + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size,
)
check(
    "FLOPs per token, counted vs model_flops_per_token()",
    counted,
    formulas.model_flops_per_token(cfg),
    rtol=0.01,
)
check("loss at init vs ln(V)", model(x, x).item(), math.log(cfg.vocab_size), rtol=0.02)

# 5. RMSNorm: one reduction per row instead of two -- but eagerly it is five kernels (a timing:
# never asserted)
xs, w = torch.randn(4096, 1024), torch.ones(1024)
for name, fn in (
    ("LayerNorm (F.layer_norm, one kernel)", lambda: torch.nn.functional.layer_norm(xs, (1024,))),
    ("RMSNorm (modern.rms_norm, eager)", lambda: rms_norm(xs, w)),
):
    fn()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    print(f"{name}: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms for (4096, 1024) fp32")
print("(fused.rms_norm does it in one pass: lesson 08)")
