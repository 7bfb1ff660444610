"""Lesson 23, the capstone: your run, graded. Plan a layout for N CPU ranks with the planner; train
a small Llama-MoE on it in one run: the sequence over cp (ring attention; the balance loss's counts
summed over cp), the experts over ep, the layers over pp (N >= 8), the rest dp; every axis's bytes
against its formula; a rank killed under torchrun and the job resumed bitwise; MFU and the bubble
reported. Each `check` line is one row of the rubric (lessons/23-capstone.md); the script exits 1 if
any fails.

    python lessons/23_capstone.py                        # N = 4 ranks: the rubric end to end
    python lessons/23_capstone.py --ranks 8              # N = 8 (pp 2)
    python lessons/23_capstone.py --plant cp-method      # the run is not the planned one: must FAIL
"""

import argparse
import contextlib
import gzip
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import kill_resume  # noqa: E402
from check import check  # noqa: E402
from nanomega import dist, formulas, moe, train, worlds  # noqa: E402
from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.job import meter  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.tools import plan  # noqa: E402

# your model: a Llama block (4 heads sharing 2 key/value heads, SwiGLU 352 wide), 4 experts, top-2
L, H, HEADS, KV, F, S, V, E, K = 2, 64, 4, 2, 352, 32, 4096, 4, 2
B, M, STEPS, KILL = 2, 2, 6, 3  # micro-batch, micro-batches per dp rank, steps; the kill at >= KILL
CP, EP = 2, 2  # the sequence over 2 ranks (ring), the 4 experts over 2
MODEL = ["--arch", "llama", "--n-layer", str(L), "--n-head", str(HEADS), "--n-kv-head", str(KV)]
MODEL += ["--n-embd", str(H), "--ffn-hidden", str(F), "--block-size", str(S)]
MODEL += [
    "--batch-size",
    str(B),
    "--dropout",
    "0",
]  # no attention dropout under cp (kill_resume: 0.1)
EXPERTS = ["--n-experts", str(E), "--top-k", str(K)]


def planned(ranks, pin):
    """The planner's first (recommended) layout for this model on `ranks` CPU ranks, pins given."""
    argv = ["--model", "llama-small", "--layers", str(L), "--hidden", str(H), "--seq", str(S)]
    # global batch b M dp, dp = ranks / (pp cp) = 2
    argv += ["--gpus", str(ranks), "--global-batch", str(B * M * 2), "--micro-batch", str(B)]
    argv += ["--dtype", "fp32", "--json", *pin, *EXPERTS]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan.main(argv)
    answer = json.loads(out.getvalue())
    return answer["parameters"], answer["estimates"][0]


def trained(corpus, out, argv):
    """One rank of a 1-step run: its grid's byte counts and, for the experts' all-to-all, the
    formula summed over the (layer, micro-batch) routings this rank saw."""
    grid, routed, real_grid, real_forward = {}, [], dist.Grid.__init__, moe.MoE.forward

    def keep(self, *a, **kw):  # a handle on the grid train.main builds
        real_grid(self, *a, **kw)
        grid["it"] = self

    def record(self, *a, **kw):  # each MoE forward's chosen experts
        y = real_forward(self, *a, **kw)
        routed.append(self.last["experts"].flatten())
        return y

    dist.Grid.__init__, moe.MoE.forward = keep, record
    train.main(
        [*argv, "--max-steps", "1", "--eval-every", "0", "--corpus", corpus, "--out-dir", out]
    )
    g = grid["it"]
    counts = {k: v[1] for k, v in g.log.counts.items()}
    wire = {axis: g.log.wire_bytes(axis) for axis in ("cp",)}

    # ep: rows to other ranks' experts and rows from theirs (expert e lives on ep rank e // (E/ep))
    want = 0
    if g.ep.size > 1:
        owners = [(experts // (E // g.ep.size)).tolist() for experts in routed]
        theirs = g.ep.all_gather_object(owners)
        for i in range(len(routed)):
            out_rows = sum(o != g.ep.rank for o in owners[i])
            in_rows = sum(
                sum(o == g.ep.rank for o in t[i]) for r, t in enumerate(theirs) if r != g.ep.rank
            )
            want += formulas.moe_all_to_all_bytes(
                out_rows, in_rows, H, 4, g.ep.size, E // g.ep.size
            )
    coords = dict(dp=g.dp_rank, pp=g.pp_rank, cp=g.cp.rank, ep=g.ep.rank)
    return dict(
        coords=coords,
        counts=counts,
        wire=wire,
        ep_want=want,
        stage=stage_params(g),
        edp=g.edp.size,
        micro=len(routed) // (L // g.pp.size),  # MoE forwards per layer: the micro-batches
    )


def stage_params(g):
    """Dense (not expert) parameters of this rank's pipeline stage, counted on the meta device: the
    ones the dp (or dp x cp) all-reduce carries; the tied head's copy on the last stage."""
    cfg = GPTConfig(
        vocab_size=V, block_size=S, n_layer=L, n_head=HEADS, n_embd=H, arch="llama",
        n_kv_head=KV, ffn_hidden=F, n_experts=E if g.ep.size > 1 else 0, top_k=K,
    )  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    per = L // g.pp.size
    mine = range(g.pp_rank * per, (g.pp_rank + 1) * per)
    n = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "experts" in parts:
            continue
        if parts[0] == "blocks" and int(parts[1]) not in mine:
            continue
        first, last = g.pp_rank == 0, g.pp_rank == g.pp.size - 1
        if parts[0] == "blocks" or (parts[0] == "embed" and (first or last)):
            n += p.numel()  # this stage's blocks; the tied embedding (the last stage's head copy)
        elif parts[0] == "head" and last:
            n += p.numel()  # the final norm
    return n


def run_bytes(n, corpus, out, argv, m):
    """Rubric rows 4-10: one step's bytes on every axis, per pipeline stage (dp rank 0, cp rank
    0)."""
    ranks = worlds.launch(trained, n, corpus, out, argv)
    pp = max(r["coords"]["pp"] for r in ranks) + 1
    stages = [r for r in ranks if r["coords"]["dp"] == 0 and r["coords"]["cp"] == 0]
    for r in sorted(stages, key=lambda r: r["coords"]["pp"]):
        c, st = r["counts"], r["coords"]["pp"]
        ends = (st > 0) + (st < pp - 1)  # neighbours: activations forward, gradients back
        check(
            f"stage {st}: pp bytes sent = m b (s/cp) h x 4 x neighbours",
            c.get(("send", "pp", "float32"), 0),
            ends * m * B * S // CP * H * 4,
        )
        check(
            f"stage {st}: ep all-to-all bytes vs formulas.moe_all_to_all_bytes per layer and micro-batch",
            c.get(("all_to_all", "ep", "float32"), 0) + c.get(("all_to_all", "ep", "int64"), 0),
            r["ep_want"],
        )
        check(
            f"stage {st}: dp x cp all-reduce = 4 x dense stage params + 4 (loss) + 16 (the vote)",
            c[("all_reduce", "dpcp", "float32")],
            4 * r["stage"] + 20,
        )
        experts = formulas.moe_expert_params(H, F, E // EP) * (L // pp)  # this rank's experts
        check(
            f"stage {st}: expert replicas (edp = dp/ep x cp) all-reduce = 4 x the rank's experts",
            c[("all_reduce", "edp", "float32")],
            4 * experts if r["edp"] > 1 else 0,
        )
        check(
            f"stage {st}: tied embedding all-reduce = 4 V h (pp > 1)",
            c.get(("all_reduce", "emb", "float32"), 0),
            4 * V * H if pp > 1 else 0,
        )

    # cp (rank 0): the ring's K/V every layer, and the balance loss's counts every MoE layer
    r = ranks[0]
    fwd, bwd = formulas.cp_comm_bytes_per_layer("ring", CP, B, S, H // HEADS, HEADS, KV, 4, 4)
    counts = formulas.moe_cp_balance_bytes(B, E, L // pp, r["micro"], CP)
    check(
        "cp count all-reduces = formulas.moe_cp_balance_bytes (b E x 4 per MoE layer and micro-batch)",
        r["counts"].get(("all_reduce", "cp", "float32"), 0),
        counts,
    )
    check(
        "cp wire bytes = L/pp m (ring forward + backward) + 2(cp-1)/cp x the count all-reduces",
        r["wire"]["cp"],
        L // pp * m * (fwd + bwd) + 2 * (CP - 1) / CP * counts,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="N CPU ranks: 4 (pp 1) or 8 (pp 2)")
    ap.add_argument("--plant", choices=["none", "cp-method"], default="none")
    ap.add_argument("--parts", default="train,kill", help="of train,kill (the plan always runs)")
    args = ap.parse_args(argv)
    n, threads, parts = args.ranks, torch.get_num_threads(), args.parts.split(",")
    if n not in (4, 8):
        ap.error(f"--ranks {n}: 4 (dp 2 x cp 2) or 8 (dp 2 x pp 2 x cp 2)")
    tmp = tempfile.mkdtemp(prefix="capstone-")
    corpus = os.path.join(tmp, "small.txt")
    Path(corpus).write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(200_000))

    # 1. plan: cp 2 (ring), ep 2, pp N/4 pinned; the planner picks dp, ZeRO and the micro-batches
    pp = n // 4
    pin = ["--tp", "1", "--pp", str(pp), "--cp", str(CP), "--cp-method", "ring", "--ep", str(EP)]
    moe_params, lay = planned(n, pin)
    m = lay["micro_batches"]
    print(
        f"the plan for {n} ranks: tp {lay['tp']} pp {lay['pp']} cp {CP} dp {lay['dp']} (ep {EP}) "
        f"zero {lay['zero']}, {m} micro-batches"
    )
    with torch.device("meta"):
        cfg = GPTConfig(
            vocab_size=V, block_size=S, n_layer=L, n_head=HEADS, n_embd=H, arch="llama",
            n_kv_head=KV, ffn_hidden=F, n_experts=E, top_k=K,
        )  # fmt: skip
        counted = sum(p.numel() for p in GPT(cfg).parameters())
    check("the planner's parameters vs the model's, counted on meta", moe_params, counted)
    check("the plan's ranks tp x pp x cp x dp", lay["tp"] * lay["pp"] * CP * lay["dp"], n)
    pipe = formulas.pipeline_bubble(lay["pp"], m)
    check("the planner's bubble vs (p-1)/(m+p-1)", lay["bubble"], pipe, atol=1e-4)

    # 2. train the planned layout one step; every axis's bytes vs its formula. The plant: the run
    # attends with all-gather K/V, not the planned ring
    torch.set_num_threads(1)  # a rank's peak: each rank of a local world runs one thread
    peak = meter.measure_matmul(torch.device("cpu"), torch.float32, seconds=0.3)[0]
    torch.set_num_threads(threads)
    method = "allgather" if args.plant == "cp-method" else "ring"
    layout = ["--tp", "1", "--pp", str(lay["pp"]), "--ep", str(EP), "--zero", str(lay["zero"])]
    layout += ["--cp", str(CP), "--cp-method", method]
    moe_argv = [*MODEL, *EXPERTS, *layout, "--grad-accum", str(m), "--peak-flops", f"{peak:.3g}"]
    if "train" in parts:
        run_bytes(n, corpus, os.path.join(tmp, "moe"), moe_argv, m)
    if "kill" not in parts:
        return

    # 3. kill the last rank of the run at step >= 3 of 6 under torchrun (a save every 2 steps):
    # restarted, resumed from a checkpoint, bitwise
    same, killed, resumed, secs = kill_resume.trial(corpus, tmp, n, STEPS, KILL, n - 1, moe_argv)
    print(f"killed rank {n - 1}: {killed}; restarted and resumed {resumed}x; {secs:.0f} s in all")
    check(
        "final weights after kill + restart vs the uninterrupted run (1 = bitwise)",
        int(same and killed),
        1,
    )
    check("the restarted job resumed from a checkpoint (1 = yes)", int(resumed > 0), 1)

    # 4. MFU and the bubble of the uninterrupted run
    ref = kill_resume.reference(corpus, tmp, n, STEPS, moe_argv)
    last = json.loads((Path(ref) / "metrics.jsonl").read_text().splitlines()[-1])
    print(
        f"MFU {last['mfu']:.1%} of a {peak / 1e9:.1f} GFLOP/s one-thread matmul peak per rank "
        f"(measured; {n} ranks share this CPU's cores); the bubble (p-1)/(m+p-1) = {pipe:.3f} at "
        f"p = {lay['pp']}, m = {m}"
    )


if __name__ == "__main__":
    main()
