"""Lesson 07: context parallelism on 4 CPU ranks -- ring, all-gather and Ulysses equal full
attention; their bytes per layer equal the formulas; head/tail chunks balance the causal work that
contiguous chunks do not."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from check import check  # noqa: E402
from nanomega import cp, dist, formulas, worlds  # noqa: E402
from tolerance import likely  # noqa: E402

CP, B, H, KV, S, HD = 4, 1, 4, 4, 256, 16  # 4 key/value heads: Ulysses at cp 4 needs cp | n_kv


def run():
    grid = dist.Grid(cp=CP)
    axis, out = grid.cp, {}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, HD, generator=gen, requires_grad=True) for n in (H, KV, KV))
    dout = torch.randn(B, H, S, HD, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.backward(dout)
    mine = lambda t: cp.local(t.detach(), CP, axis.rank, dim=2)
    for method in cp.METHODS:
        x = [mine(t).requires_grad_() for t in (q, k, v)]
        grid.log.reset()
        cp.WORK.update(pairs=0.0, flops=0)
        y = cp.attention(*x, axis, method)
        fwd, pairs = grid.log.wire_bytes("cp"), cp.WORK["pairs"]
        y.backward(mine(dout))
        err = max(
            ((a - mine(b)).abs().max() / b.abs().max()).item()
            for a, b in ((y, ref), (x[0].grad, q.grad), (x[1].grad, k.grad), (x[2].grad, v.grad))
        )
        out[method] = dict(err=err, fwd=fwd, bwd=grid.log.wire_bytes("cp") - fwd, pairs=pairs)
    # contiguous chunks (rank c holds tokens [c s/cp, (c+1) s/cp)): the causal work piles up on the
    # last rank
    x = [t.detach().chunk(CP, 2)[axis.rank] for t in (q, k, v)]
    cp.WORK.update(pairs=0.0)
    cp.attention(*x, axis, "ring", balanced=False)
    out["contiguous"] = cp.WORK["pairs"]
    scores = (q @ k.transpose(-2, -1)).abs().max().item() / HD**0.5
    # tests/test_cp.py's derivation
    out["bound"] = 2 * likely(S) * (6 + 2 * CP) ** 0.5 * max(1.0, scores)
    return out


if __name__ == "__main__":
    ranks = worlds.launch(run, CP)
    print(
        f"== attention over cp = {CP} ranks: b {B}, {H} heads, {KV} key/value heads, s {S}, head size {HD}, fp32"
    )
    for method in cp.METHODS:
        worst = max(r[method]["err"] for r in ranks)
        check(
            f"{method:<9} output and q/k/v gradients within the derived bound of full attention (1 = yes)",
            int(worst <= ranks[0]["bound"]),
            1,
        )
        print(
            f"  {method}: largest relative difference {worst:.2e} (bound {ranks[0]['bound']:.2e})"
        )
    print("== bytes one rank puts on the wire per layer (formulas.cp_comm_bytes_per_layer)")
    for method in cp.METHODS:
        fwd, bwd = formulas.cp_comm_bytes_per_layer(method, CP, B, S, HD, H, KV, 4, 4)
        check(f"{method:<9} forward bytes", ranks[0][method]["fwd"], fwd, unit=" B")
        check(f"{method:<9} backward bytes", ranks[0][method]["bwd"], bwd, unit=" B")
    print("== causal work per rank, in (s / 2cp)^2 chunk pairs (a diagonal pair: half)")
    balanced = [r["ring"]["pairs"] for r in ranks]
    # a contiguous chunk is 2x longer: 4x the pairs
    contiguous = [4 * r["contiguous"] for r in ranks]
    print(f"  head + tail chunks {balanced}; contiguous chunks {contiguous}")
    check("head/tail: every rank does 2 cp pairs", max(balanced) - min(balanced), 0)
    check("head/tail: pairs per rank = pairs_per_rank", balanced[0], cp.pairs_per_rank(CP)[0])
    check(
        "contiguous: the last rank's work / the mean (the step waits for it)",
        max(contiguous) / (sum(contiguous) / CP),
        2 * (2 * CP - 1) / (2 * CP),
    )
