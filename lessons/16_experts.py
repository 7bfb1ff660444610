"""Lesson 16: experts -- routing, balancing, capacity and the all-to-all, counted and measured on a
CPU. --figure PATH: also draw the expert loads over training with and without the balancing bias
(matplotlib)."""

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import compose, dist, formulas, moe, train, worlds  # noqa: E402
from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.job import flags  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
FLAGS = [
    "--arch",
    "llama",
    "--n-layer",
    "2",
    "--n-head",
    "4",
    "--n-embd",
    "32",
    "--ffn-hidden",
    "64",
    "--block-size",
    "32",
    "--n-experts",
    "4",
    "--top-k",
    "2",
    "--device",
    "cpu",
    "--weight-decay",
    "0",
]
VOCAB = 256
RATE = 0.005  # the bias step per optimizer step (DeepSeek-V3: 0.001 over thousands of steps)


def build(argv, dp=1, ep=1):
    config = dataclasses.replace(
        flags.parse(FLAGS + argv + ["--ep", str(ep)]), dp=dp, vocab_size=VOCAB
    )
    grid = dist.Grid(dp, 1, 1, ep=ep)
    model, engine, _ = compose.build(config, grid)
    return config, grid, model, engine


def data(n, seed=0):
    tokens = torch.randint(0, VOCAB, (n, 33), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def all_to_all():
    """Rank r of dp2 x ep2: one micro-batch forward and backward; its all-to-all bytes against the
    formula."""
    config, grid, model, engine = build(["--batch-size", "4"], dp=2, ep=2)
    x, y = data(8)
    mine = slice(4 * grid.dp_rank, 4 * grid.dp_rank + 4)
    grid.log.reset()
    train.forward_backward(model, engine, grid, [(x[mine], y[mine])], config)
    measured, want, out_rows, tokens = grid.log.bytes("all_to_all", "ep"), 0, 0, 0
    for layer in moe.layers(model).values():
        owner = (layer.last["experts"] // 2).flatten()  # expert e on ep rank e // (E/ep)
        theirs = grid.ep.all_gather_object(owner.tolist())[1 - grid.ep.rank]
        rows_out, rows_in = (
            int((owner != grid.ep.rank).sum()),
            sum(o == grid.ep.rank for o in theirs),
        )
        want += formulas.moe_all_to_all_bytes(rows_out, rows_in, 32, 4, 2, 2)
        out_rows, tokens = out_rows + rows_out, tokens + owner.numel() // 2
    return measured, want, out_rows, formulas.moe_balanced_rows(tokens, 2, 2)


def loads_over_training(rate, steps=40, lr=0.0):
    """Steps over one batch with no aux loss; the max/mean expert load of every step (and layer 0's
    loads), bias rate `rate`. lr 0: the weights frozen, only the bias moves (with lr 3e-3 on these
    random tokens the router's own drift, 1.13 -> 1.32 in 40 steps, outran rates 0.01 and 0.05; over
    new batches each step the sampling noise of 512 assignments, max/mean ~1.1, hid the effect: both
    measured, not shown)."""
    config, grid, model, engine = build(
        ["--batch-size", "8", "--moe-aux-loss", "0", "--lr", str(lr or 1e-9)]
    )
    config = dataclasses.replace(config, lr=lr)
    history, per_expert = [], []
    for _step in range(steps):
        engine.set_lr(config.lr)
        # one batch: its routing noise fixed
        train.forward_backward(model, engine, grid, [data(8)], config)
        engine.step(clip_norm=1.0)
        load = moe.step_stats(model, grid)["load"]
        history.append((load.max(1).values / load.mean(1)).max().item())
        per_expert.append((load[0] / load[0].sum()).tolist())
        moe.update_bias(model, load, rate)
    return history, per_expert


def main(figure=None):
    # 1. parameters: total vs active (Mixtral 8x7B's shape), counted on meta
    cfg = GPTConfig(
        vocab_size=32000,
        n_layer=1,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        ffn_hidden=14336,
        arch="llama",
        n_experts=8,
        top_k=2,
        tie_embeddings=False,
        block_size=4096,
    )
    with torch.device("meta"):
        block = sum(p.numel() for p in GPT(cfg).blocks["0"].parameters())
    total, active = formulas.moe_layer_params(4096, 14336, 32, 8, 8, 2)
    check("Mixtral 8x7B block parameters, counted on meta vs formula", block, total)
    full = 32 * total + 2 * 32000 * 4096 + 4096
    n_active = 32 * active + 2 * 32000 * 4096
    print(
        f"Mixtral 8x7B: {full / 1e9:.1f} B parameters, {n_active / 1e9:.1f} B active per token: "
        f"6 N_active = {6 * n_active / 1e9:.0f} GFLOP/token of training, "
        f"{6 * (n_active - 32000 * 4096) / 1e9:.0f} without the input embedding (a lookup, not a matmul)"
    )
    # 2. the routing conventions: Mixtral's softmax over the top-k logits = softmax over all, top-k,
    # renormalized (Qwen3-MoE's); without the renormalization (DeepSeek-V2's, Qwen2-MoE's) the same
    # experts, weights summing to less than 1
    logits = torch.randn(1000, 8)
    w_mixtral, e_mixtral, _ = moe.route(logits, 2, "mixtral")
    w_norm, e_norm, _ = moe.route(logits, 2, "softmax_topk_norm")
    w_plain, e_plain, _ = moe.route(logits, 2, "softmax_topk")
    check("mixtral vs softmax_topk_norm: same experts", int((e_mixtral != e_norm).sum()), 0)
    # a few ulps apart (the two softmaxes round differently, by CPU): count the weights that differ
    # by more
    check(
        "mixtral vs softmax_topk_norm: weights more than 1e-6 apart",
        int(((w_mixtral - w_norm).abs() > 1e-6).sum()),
        0,
    )
    check("softmax_topk vs softmax_topk_norm: same experts", int((e_plain != e_norm).sum()), 0)
    check(
        "softmax_topk: tokens whose weights sum to 1 or more (of 1000)",
        int((w_plain.sum(-1) >= 1).sum()),
        0,
    )
    # 3. the aux loss: 1 when balanced, E when one expert takes every token
    s, E = 64, 8
    uniform = torch.full((1, s, E), 1 / E)
    spread = torch.arange(s * 2).view(1, s, 2) % E  # every expert gets s k / E assignments
    check(
        "aux loss, uniform probabilities and loads",
        moe.balance_loss(uniform, spread, E).item(),
        1.0,
        atol=1e-6,
    )
    collapsed = torch.zeros(1, s, E).index_fill_(2, torch.tensor([0]), 1.0)
    check(
        "aux loss, one expert takes all",
        moe.balance_loss(collapsed, torch.zeros(1, s, 1, dtype=torch.long), E).item(),
        E,
        atol=1e-6,
    )
    # 4. capacity: cf = 1 keeps at most ceil(s k / E) assignments per expert and sequence
    experts = torch.randn(4, s, E).topk(2, dim=-1).indices
    keep = moe.within_capacity(experts, E, moe.capacity(1.0, s, 2, E))
    kept = torch.stack([torch.bincount(experts[b][keep[b]], minlength=E) for b in range(4)])
    check(
        "capacity factor 1: most kept per (sequence, expert) vs ceil(s k / E)",
        kept.max().item(),
        moe.capacity(1.0, s, 2, E),
    )
    print(
        f"random routing, cf 1: {1 - keep.float().mean().item():.1%} of the assignments dropped; cf 1.25: "
        f"{1 - moe.within_capacity(experts, E, moe.capacity(1.25, s, 2, E)).float().mean().item():.1%}; "
        f"cf 0 (dropless): 0%"
    )
    # 5. the all-to-all of dp2 x ep2, rank by rank
    for rank, (measured, want, rows, balanced) in enumerate(worlds.launch(all_to_all, 2)):
        check(f"rank {rank} all-to-all bytes (2 layers, fwd + bwd) vs formula", measured, want)
        print(
            f"rank {rank}: {rows} rows sent to the other rank's experts; uniform routing would send {balanced:.0f}"
        )
    # 6. balancing by the bias alone (no aux loss, frozen weights): the loads over 40 steps on one
    # batch
    (off, off_loads), (on, on_loads) = worlds.launch(run_both, 1)[0]
    print(
        f"max/mean expert load, no balancing: step 1 {off[0]:.2f}, last 10 steps {sum(off[-10:]) / 10:.2f}; "
        f"bias {RATE}: {on[0]:.2f} -> {sum(on[-10:]) / 10:.2f}"
    )
    check(
        "the bias brings the loads closer to uniform (last 10 steps' max/mean load, ratio < 1)",
        float(sum(on[-10:]) < sum(off[-10:])),
        1.0,
    )
    if figure:
        draw(figure, off_loads, on_loads)


def run_both():
    return loads_over_training(0.0), loads_over_training(RATE)


def draw(path, off, on):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, loads, title in (
        (axes[0], off, "no balancing"),
        (axes[1], on, f"bias balancing (rate {RATE})"),
    ):
        for e, series in enumerate(zip(*loads)):
            ax.plot(range(1, len(series) + 1), series, label=f"expert {e}")
        ax.axhline(0.25, color="gray", linestyle=":")
        ax.set(title=title, xlabel="step")
    axes[0].set_ylabel("share of layer 0's assignments")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"figure: {path}")


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--figure") + 1] if "--figure" in sys.argv else None)
