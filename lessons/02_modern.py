"""Lesson 02: the modern block -- what Llama's four changes to GPT-2's block buy, counted and
measured on a CPU."""

import math
import os
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import formulas, mtp  # noqa: E402
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


# 5. What a token leaves behind for decoding: k and v per key/value head, or MLA's latent and rotary
# key. Measured: the widths the projections output for one token, x layers x 2 bytes (bf16)
def cache_measured(cfg):
    model, widths = GPT(cfg, seed=0), []
    for block in model.blocks.values():
        proj = block.attn.kv_a_proj if cfg.kv_lora_rank else block.attn.kv_proj
        proj.register_forward_hook(lambda m, i, out: widths.append(out.shape[-1]))
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long))
    return sum(widths) * 2


small = dict(n_layer=2, n_head=4, n_embd=64, arch="llama", vocab_size=256, block_size=16)
mla_shape = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
for name, cfg in (
    ("multi-head", GPTConfig(**small)),
    ("grouped-query, 1 kv head", GPTConfig(**small, n_kv_head=1)),
    ("latent (MLA), d_c 32 + d_r 8", GPTConfig(**small, **mla_shape)),
):
    check(
        f"KV cache B/token, {name}",
        cache_measured(cfg),
        formulas.kv_cache_bytes_per_token(cfg),
        labels=("measured", "formulas.kv_cache_bytes_per_token"),
    )
v3 = GPTConfig(**PRESETS["deepseek-v3"])
d_h = v3.mla_dims[0]  # the paper's per-head size: 128 (h / a = 56 is not one)
check(
    "deepseek-v3 KV cache B/token vs DeepSeek-V2 Table 1 (4.5 d_h l, bf16)",
    formulas.kv_cache_bytes_per_token(v3),
    4.5 * d_h * v3.n_layer * 2,
    labels=("formula", "paper"),
)
mha_v3 = 2 * v3.n_head * d_h * v3.n_layer * 2  # 2 a d_h l, bf16
gqa405 = formulas.kv_cache_bytes_per_token(GPTConfig(**PRESETS["llama3-405b"]))
print(
    f"deepseek-v3 {formulas.kv_cache_bytes_per_token(v3):,} B/token; its 128 heads of {d_h} as "
    f"multi-head {mha_v3:,} ({mha_v3 / formulas.kv_cache_bytes_per_token(v3):.0f}x); "
    f"llama3-405b (GQA 8) {gqa405:,}"
)

# 6. MTP's extra loss: one module (D 1, lambda 0.3) predicting t_(i+2); the step's row books its
# cross-entropy (mtp.step_stats). At initialization both losses are ln V; the reported loss stays
# the LM's, the MTP term joins only the backward. A few steps on one batch: both fall
mtp_cfg = GPTConfig(**small, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
one = type("One", (), dict(size=1, all_reduce=staticmethod(lambda t: t)))
grid = type("Grid", (), dict(device=torch.device("cpu"), dp_cp=one, pp=one))
with_mtp, without = GPT(mtp_cfg, seed=0), GPT(GPTConfig(**small), seed=0)
x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
x, y = x[:, :-1], x[:, 1:]
loss = with_mtp(x, y)
check(
    "reported loss, the LM loss",
    loss.item(),
    without(x, y).item(),
    labels=("with MTP", "without MTP"),
)
loss.backward()
check(
    "MTP cross-entropy at init vs ln(V)",
    mtp.step_stats(with_mtp, grid)["mtp_loss"],
    math.log(256),
    rtol=0.05,
)
opt = torch.optim.AdamW(with_mtp.parameters(), lr=3e-3)
for step in range(1, 31):
    opt.zero_grad()
    loss = with_mtp(x, y)
    loss.backward()
    opt.step()
    if step % 10 == 0:
        row = mtp.step_stats(with_mtp, grid)
        print(
            f"step {step}: LM loss {loss.item():.3f}, MTP loss (t_(i+2)) {row['mtp_loss']:.3f}, "
            f"objective LM + 0.3 x MTP = {loss.item() + 0.3 * row['mtp_loss']:.3f}"
        )
    else:
        mtp.step_stats(with_mtp, grid)  # the booking read every step, as train.py does

# 7. RMSNorm: one reduction per row instead of two -- but eagerly it is five kernels (a timing:
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
print("(fused.rms_norm does it in one pass: lesson 13)")
