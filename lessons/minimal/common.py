"""The minimal-build track's shared pieces: one small GPT, its batches, its optimizer, and the dense
run that every file of the track must equal, bitwise.

Why bitwise is possible: a data- or pipeline-parallel step computes the same per-token math as one
process; only the order of the sums that combine the pieces (ranks, micro-batches) can differ. So
the dense reference runs the global batch as the same pieces (2 row blocks for 2 data-parallel
ranks, 4 micro-batches for the pipeline) and sums their gradients in the order the parallel run
does. A sum of two terms is exact in either order (gloo's 2-rank all-reduce), and scaling by 1/2 or
1/4 is exact in binary (so grad(l / N) = grad(l) / N bit for bit). The model is nanomega.model's GPT
in its Llama form with an untied LM head: a tied head would live on both end stages of a pipeline,
and summing its two gradients there (nanomega/pp.py does) is a sum in another order than one
process's.
Lesson: lessons/README.md (the minimal-build track); checked by tests/test_minimal.py
"""

import torch

from nanomega.gpt_config import GPTConfig

from nanomega.model import GPT

STEPS, BATCH, LR = 3, 4, 1e-2
CONFIG = GPTConfig(
    vocab_size=256,
    block_size=16,
    n_layer=2,
    n_head=4,
    n_embd=32,
    arch="llama",
    tie_embeddings=False,
)


def model():
    """The full model, the same on every rank (every parameter is drawn from seed 0 by its name)."""
    return GPT(CONFIG, seed=0)


def batch(step):
    """The global batch of one step, the same on every rank: ids and next-token targets, (BATCH, s)
    each. Two random batches in turn: the model learns them by heart, so the loss falls from ln 256
    = 5.55 within steps."""
    ids = torch.randint(
        CONFIG.vocab_size,
        (BATCH, CONFIG.block_size + 1),
        generator=torch.Generator().manual_seed(step % 2),
    )
    return ids[:, :-1], ids[:, 1:]


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def dense(pieces, steps=STEPS):
    """One process, one model: each step's batch as `pieces` row blocks, each block's loss / pieces
    backward (gradients add up in .grad in block order), then one AdamW step. Returns (losses,
    {name: values})."""
    net = model()
    opt, losses = optimizer(net.parameters()), []
    for step in range(steps):
        idx, targets = batch(step)
        total = torch.zeros(())
        for x, y in zip(idx.chunk(pieces), targets.chunk(pieces)):
            loss = net(x, y) / pieces
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return losses, weights(net)


def weights(net):
    """{name: values as a list}: plain Python floats (exact for fp32) travel back from a spawned
    rank."""
    return {name: p.detach().reshape(-1).tolist() for name, p in net.named_parameters()}


def stage(rank, stages):
    """Pipeline stage `rank` of `stages`: the full model built, then cut to its contiguous share of
    the blocks; the first stage keeps the embedding, the last the head (GPT.forward skips a part
    that is None)."""
    if CONFIG.n_layer % stages:
        raise ValueError(
            f"{CONFIG.n_layer} layers do not split into {stages} stages; run 1, 2 or {CONFIG.n_layer} ranks"
        )
    net = model()
    per = CONFIG.n_layer // stages
    for i in range(CONFIG.n_layer):
        if not rank * per <= i < (rank + 1) * per:
            del net.blocks[str(i)]
    if rank > 0:
        net.embed = None
    if rank < stages - 1:
        net.head = None
    return net
