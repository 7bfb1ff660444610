"""Lesson 00 experiment: the compute wall (6ND against GPT-3's published figure) and the memory wall
(16 bytes per parameter, measured from the tensors of a real Adam step)."""

import torch

from check import check
from nanomega.gpt_config import GPTConfig

# Compute: GPT-3 175B trained on 300B tokens (Brown et al. 2020, Table D.1 gives 3.14e23 FLOPs)
from nanomega.model import GPT

# Compute: GPT-3 175B trained on 300B tokens (Brown et al. 2020, Table D.1 gives 3.14e23 FLOPs)
N, D = 174.6e9, 300e9
check(
    "GPT-3 training FLOPs 6ND vs the paper's 3.14e23",
    6 * N * D,
    3.14e23,
    rtol=0.01,
    labels=("6ND", "published"),
)
days = 6 * N * D / (1024 * 312e12 * 0.5) / 86400
print(f"  = {days:.0f} days on 1024 A100s (312 TFLOP/s bf16) at 50% utilisation")

# Memory: Adam in mixed precision keeps bf16 params + bf16 grads + fp32 master, m and v = 2+2+4+4+4
# = 16 B
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)).to(
    torch.bfloat16
)
master = [p.detach().float().requires_grad_() for p in model.parameters()]
opt = torch.optim.Adam(master, lr=1e-3)
x = torch.randint(0, 512, (2, 32))
model(x, x).backward()  # bf16 gradients on the model
for m, p in zip(master, model.parameters()):
    m.grad = p.grad.float()
opt.step()  # creates Adam's exp_avg and exp_avg_sq
for m in master:
    m.grad = None  # fp32 gradient copies are transient
nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
n = sum(p.numel() for p in model.parameters())
total = (
    nbytes(model.parameters())
    + nbytes(p.grad for p in model.parameters())
    + nbytes(master)
    + nbytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0)
)
print(f"  {n:,} parameters hold {total:,} bytes of training state")
check(
    "bytes per parameter, Adam in mixed precision",
    total / n,
    2 + 2 + 4 + 4 + 4,
    labels=("measured", "2 + 2 + 4 + 4 + 4 ="),
)
