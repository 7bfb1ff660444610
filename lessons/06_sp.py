"""Lesson 06: sequence parallelism. The same world and measurements as lesson 05 (05_tp.py), with
the LayerNorms, dropouts and residuals of each layer on 1/t of the sequence: the bytes each layer
sends (the same as tensor parallelism, plus the backward re-gathers) and the activations it saves
(all divided by t)."""

import importlib

from check import check

lesson03 = importlib.import_module("05_tp")  # a module name cannot start with a digit in `import`
B_, S, H, A, L, E = lesson03.B_, lesson03.S, lesson03.H, lesson03.A, lesson03.L, lesson03.E

if __name__ == "__main__":
    res = lesson03.run((False, True))
    sbh, Bt, n = S * B_ * H, S * B_ * H * E, B_ * S
    print("\n--- communication of one layer: all-reduce -> reduce-scatter + all-gather ---")
    for t in (2, 4):
        sp, tp = res[(t, True)], res[(t, False)]
        check(
            f"tp={t} SP forward all-gather bytes = 2 B", sp["fwd"]["all_gather"], 2 * Bt, unit=" B"
        )
        check(
            f"tp={t} SP forward reduce-scatter bytes = 2 B",
            sp["fwd"]["reduce_scatter"],
            2 * Bt,
            unit=" B",
        )
        wire = (t - 1) / t * (sp["fwd"]["all_gather"] + sp["fwd"]["reduce_scatter"])
        check(
            f"tp={t} SP forward wire bytes = TP forward wire bytes",
            wire,
            2 * (t - 1) / t * tp["fwd"]["all_reduce"],
            unit=" B",
        )
        back = {op: sp["both"][op] - sp["fwd"][op] for op in sp["fwd"]}
        check(
            f"tp={t} SP backward reduce-scatter bytes = 2 B",
            back["reduce_scatter"],
            2 * Bt,
            unit=" B",
        )
        check(
            f"tp={t} SP backward all-gather bytes = 2 B + 2 B re-gathered",
            back["all_gather"],
            4 * Bt,
            unit=" B",
        )
        check(
            f"tp={t} SP backward all-reduce of LayerNorm and row-bias grads = 6h x 4",
            back["all_reduce"],
            6 * H * 4,
            unit=" B",
        )
        check(
            f"tp={t} SP wire bytes per layer = 10(t-1)/t B + 2(t-1)/t 24h",
            sp["layer_wire"],
            10 * (t - 1) / t * Bt + 2 * (t - 1) / t * 24 * H,
            unit=" B",
        )
    # + the embedding (RS / AG), the LM head's input (AG, RS, re-gather) and the loss
    for t in (2, 4):
        step = res[(t, True)]["step"]
        check(
            f"tp={t} SP all-gather bytes per step = (6L + 3) B",
            step["all_gather"],
            (6 * L + 3) * Bt,
            unit=" B",
        )
        check(
            f"tp={t} SP reduce-scatter bytes per step = (4L + 2) B",
            step["reduce_scatter"],
            (4 * L + 2) * Bt,
            unit=" B",
        )
        # LayerNorms, row biases, ln_f, positions: their grads
        replicated = L * 6 * H + 2 * H + S * H
        check(
            f"tp={t} SP all-reduce bytes per step = replicated grads + 3n x 4",
            step["all_reduce"],
            replicated * 4 + 3 * n * 4,
            unit=" B",
        )
    print("\n--- activations one layer saves for backward (elements; dropout 0.1) ---")
    for t in (1, 2, 4):
        saved = res[(t, True)]["saved"]
        act, mask, _ = lesson03.activation_formula(t, sp=True)
        check(f"tp={t} SP activation elements = 16sbh/t + 2as^2b/t", saved["act"], act)
        check(f"tp={t} SP dropout-mask elements = 2sbh/t + as^2b/t", saved["mask"], mask)
        paper = 2 * saved["act"] + saved["mask"]
        check(
            f"tp={t} SP bytes at 2 per activation, 1 per mask = sbh(34/t + 5as/(ht))",
            paper,
            sbh * (34 / t + 5 * A * S / (H * t)),
            unit=" B",
        )
        no_sp = res[(t, False)]["saved"]
        print(
            f"  tp={t}: with SP {paper:,} B, without {2 * no_sp['act'] + no_sp['mask']:,} B (paper's bytes); "
            f"fp32 here {E * (saved['act'] + saved['mask']):,} B"
        )
