"""Lesson 05: tensor parallelism. One world of 4 gloo ranks on this CPU holds three grids (tp = 1,
2, 4); on each, a GPT sliced from the dense one: its loss, the bytes each layer sends, and the
activations each layer saves for backward, printed next to the formulas. Lesson 06 (06_sp.py) reuses
`measure`."""

import torch
import torch.nn as nn

from check import check
from nanomega import dist, tp, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.rng import model_parallel_seed

B_, S, H, A, L = 2, 64, 64, 4, 2  # micro-batch, sequence, hidden, heads, layers
E = 4  # bytes per element: everything here is fp32 (the paper's formulas count 2-byte activations)


def config(t, dropout=0.1):
    return GPTConfig(
        vocab_size=200,
        block_size=S,
        n_layer=L,
        n_head=A,
        n_embd=H,
        dropout=dropout,
        make_vocab_size_divisible_by=128 * t,
    )


def saved_elements(block, x):
    """Run block(x) and count what autograd saved for backward, in elements, by the paper's
    categories: act (activations), mask (dropout masks: whatever a Dropout module saves), and two
    items the formula leaves out: ln_stats (LayerNorm mean and 1/std per token) and causal (the (s,
    s) bool mask, in bytes).
    Each storage is counted once; parameters are skipped."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen, count, where = set(), dict(act=0, mask=0, ln_stats=0, causal=0), [None]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            n = t.untyped_storage().nbytes() // t.element_size()
            kind = (
                "mask"
                if where[0] == "drop"
                else "ln_stats"
                if where[0] == "ln" and t.shape[-1] == 1
                else "causal"
                if t.dtype == torch.bool
                else "act"
            )
            count[kind] += n
        return t

    hooks = []
    for m in block.modules():
        kind = (
            "drop" if isinstance(m, nn.Dropout) else "ln" if isinstance(m, nn.LayerNorm) else None
        )
        if kind:
            hooks += [
                m.register_forward_pre_hook(lambda *_, k=kind: where.__setitem__(0, k)),
                m.register_forward_hook(lambda *_: where.__setitem__(0, None)),
            ]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    for h in hooks:
        h.remove()
    return count, y


def measure(grid, sp):
    """On this rank: the TP model's loss, one layer's forward/backward bytes per collective, its
    saved elements, and a whole step's bytes."""
    t, log = grid.tp.size, grid.log
    torch.manual_seed(0)
    dense = GPT(config(t))
    model = GPT(config(t))
    model.load_state_dict(dense.state_dict())
    tp.apply_tensor_parallel(model, grid.tp, sp, rng=model_parallel_seed(0, grid))
    idx = torch.randint(200, (B_, S), generator=torch.Generator().manual_seed(1))
    model.eval(), dense.eval()  # the loss check without dropout: TP must equal dense
    with torch.no_grad():
        out = dict(
            loss=model(idx, idx.roll(-1, 1)).item(), dense_loss=dense(idx, idx.roll(-1, 1)).item()
        )
    model.train()
    x = torch.randn(B_, S, H)
    # own storage: counted alone
    x = (x.chunk(t, 1)[grid.tp.rank].contiguous() if sp else x).requires_grad_()
    log.reset()
    out["saved"], y = saved_elements(model.blocks["0"], x)
    out["fwd"] = {op: log.bytes(op, "tp") for op in ("all_reduce", "all_gather", "reduce_scatter")}
    y.backward(torch.randn_like(y))
    out["both"] = {op: log.bytes(op, "tp") for op in out["fwd"]}
    out["layer_wire"] = log.wire_bytes("tp")
    log.reset()
    model(idx, idx.roll(-1, 1)).backward()
    out["step"] = {op: log.bytes(op, "tp") for op in out["fwd"]}
    return out


def world(sps):
    grids = {1: dist.Grid(4, 1, 1), 2: dist.Grid(2, 1, 2), 4: dist.Grid(1, 1, 4)}
    return {(t, sp): measure(g, sp) for t, g in grids.items() for sp in sps}


def activation_formula(t, sp):
    """Korthikanti et al.: elements of activations and of dropout masks one layer saves, and the
    bytes at 2 bytes per activation and 1 per mask element."""
    sbh, as2b = S * B_ * H, A * S * S * B_
    if sp:
        act, mask = 16 * sbh / t + 2 * as2b / t, 2 * sbh / t + as2b / t
    else:
        act, mask = 4 * sbh + 12 * sbh / t + 2 * as2b / t, 2 * sbh + as2b / t
    return act, mask, 2 * act + mask


def run(sps):
    """Launch the world; print the setting and each TP model's loss next to the dense one's. Returns
    rank 0's results (rank 0 of every grid: all tp ranks measure alike)."""
    res = worlds.launch(world, 4, sps, timeout=600)[0]
    print(
        f"b={B_} s={S} h={H} a={A} L={L}, fp32: one (b, s, h) activation is B = {S * B_ * H * E:,} bytes\n"
    )
    for sp in sps:
        for t in (2, 4):
            r = res[(t, sp)]
            check(
                f"tp={t}{' SP' if sp else ''} loss vs dense", r["loss"], r["dense_loss"], rtol=1e-5
            )
    return res


if __name__ == "__main__":
    res = run((False,))
    sbh, Bt = S * B_ * H, S * B_ * H * E
    print(
        "\n--- communication of one layer (tp ranks, bytes this rank passes to the collective) ---"
    )
    for t in (2, 4):
        r = res[(t, False)]
        check(f"tp={t} forward all-reduce bytes = 2 B", r["fwd"]["all_reduce"], 2 * Bt, unit=" B")
        check(
            f"tp={t} backward all-reduce bytes = 2 B",
            r["both"]["all_reduce"] - r["fwd"]["all_reduce"],
            2 * Bt,
            unit=" B",
        )
        check(
            f"tp={t} wire bytes per layer = 4 x 2(t-1)/t B",
            r["layer_wire"],
            4 * 2 * (t - 1) / t * Bt,
            unit=" B",
        )
    n = B_ * S  # tokens
    # a whole step adds the embedding (g forward), the LM head (f backward) and the loss
    for t in (2, 4):
        check(
            f"tp={t} all-reduce bytes per step = (4L + 2) B + 3n x 4",
            res[(t, False)]["step"]["all_reduce"],
            (4 * L + 2) * Bt + 3 * n * 4,
            unit=" B",
        )
    print("\n--- activations one layer saves for backward (elements; dropout 0.1) ---")
    for t in (1, 2, 4):
        saved = res[(t, False)]["saved"]
        act, mask, paper = activation_formula(t, sp=False)
        check(f"tp={t} activation elements = sbh(4 + 12/t) + 2as^2b/t", saved["act"], act)
        check(f"tp={t} dropout-mask elements = 2sbh + as^2b/t", saved["mask"], mask)
        check(
            f"tp={t} bytes at 2 per activation, 1 per mask = sbh(10 + 24/t + 5as/(ht))",
            2 * saved["act"] + saved["mask"],
            sbh * (10 + 24 / t + 5 * A * S / (H * t)),
            unit=" B",
        )
        print(
            f"  tp={t} measured fp32 bytes on this CPU: {E * (saved['act'] + saved['mask']):,} "
            f"(+ not in the formula: LayerNorm statistics {E * saved['ln_stats']:,} B, "
            f"causal mask {saved['causal']:,} B)"
        )
