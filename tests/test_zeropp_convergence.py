"""ZeRO++ converges as plain ZeRO-3 does (issue 46): 2 hosts x 2 ranks (dist.Grid(4, dp_shard=2)),
a 2-layer MLP fitting a fixed teacher (test_onebit's task), RUN steps of ZeRO-3 with each scheme.

The bound, stated (no trajectory bound is derived: qwZ's is derived for the first step only, in
test_zeropp): after RUN steps (the mean of the last 3 held-out losses) a scheme's loss is above
plain ZeRO-3's by at most 20% of what plain ZeRO-3 gained from its first held-out loss; the tolerance
test_onebit's convergence test states for 1-bit Adam (Tang et al. 2021's sample-wise claim), here
for ZeRO++, whose authors (Wang et al. 2023, arXiv 2306.10209) claim convergence as the baseline's
(their curves are not checked here). Seen on AMD AVX2: qwZ 8 -1.4e-4, qgZ 8 -2.9e-5, all three
-1.1e-4 of the gain: the bound catches gross faults only. hpZ moves no value: bitwise plain
(asserted). The planted fault, qwZ without its scales (the int8 codes taken as the weights), must
fail the bound (seen: 1.6e5).
"""

import pytest
import torch
from torch import nn

from nanomega import dist, worlds, zeropp
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import Replicas, weight_decay_groups
from test_onebit import _teacher_batch

pytestmark = pytest.mark.usefixtures("one_thread")
RUN, EVAL = 40, 8
SCHEMES = {
    "plain": dict(),
    "hpz": dict(hpz=True),
    "qwz8": dict(qwz=8),
    "qgz8": dict(qgz=8),
    "all": dict(qwz=8, hpz=True, qgz=8),
    "planted": dict(qwz=8),
}
BOUND = 0.2


class NoScales(zeropp.QuantizedGather):
    """The planted fault: the gathered codes dequantized with every scale 1."""

    def arrive(self, g):
        full, scales = self.pending.pop(id(g))
        values = zeropp.dequantize(full, torch.ones_like(scales), g.shard_numel, self.bits)
        g.full.copy_(values.reshape(-1).to(g.dtype))


class Planted(zeropp.Plan):
    def wire(self):
        return NoScales(self.qwz, self.block)


def _curves(grid):
    """Held-out losses every EVAL steps of each scheme (the same seed, data and schedule)."""
    held, curves = _teacher_batch(-1, 0, 2048), {}
    for name, scheme in SCHEMES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        plan = (Planted if name == "planted" else zeropp.Plan)(
            **scheme, inside=grid.dp_shard, across=grid.dp_rep
        )
        options = weight_decay_groups(weight_decay=0.0, lr=1e-2, betas=(0.9, 0.95))
        engine = ZeroEngine(
            model,
            torch.optim.AdamW,
            options,
            grid,
            3,
            replicas=[Replicas("dense", grid.dp)],
            zeropp=plan,
        )
        curves[name] = []
        for step in range(RUN):
            x, y = _teacher_batch(step, grid.dp.rank)  # (32, 16), (32, 4) per rank
            (engine.module(x) - y).square().mean().backward()
            engine.step()
            if step % EVAL == 0 or step == RUN - 1:
                with torch.no_grad():
                    loss = (engine.module(held[0]) - held[1]).square().mean().double()
                curves[name].append(grid.dp.all_reduce(loss.reshape(1)).item() / grid.dp.size)
    return curves


def _world():
    return _curves(dist.Grid(4, 1, 1, dp_shard=2))


@pytest.fixture(scope="module")
def curves():
    return worlds.launch(_world, 4, timeout=600)[0]


def test_each_scheme_converges_as_plain_zero3_and_qwz_without_scales_does_not(curves):
    final = {k: sum(c[-3:]) / 3 for k, c in curves.items()}
    gained = curves["plain"][0] - final["plain"]
    assert gained > 0.3 * curves["plain"][0], curves["plain"]  # it learned
    assert curves["hpz"] == curves["plain"]  # hpZ: the same values, from inside the host
    gap = {k: (final[k] - final["plain"]) / gained for k in SCHEMES if k != "plain"}
    print({k: f"{v:.3e}" for k, v in gap.items()})
    for k in ("hpz", "qwz8", "qgz8", "all"):
        assert gap[k] <= BOUND, (k, gap, curves)
    assert gap["planted"] > BOUND, (gap, curves["planted"])
