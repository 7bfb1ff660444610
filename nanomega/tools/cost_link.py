"""The data-parallel step on two links: what crosses inside a host and between hosts under plain
ZeRO, hybrid sharding (--dp-shard), ZeRO++ (qwZ, hpZ, qgZ) and 1-bit Adam, how long each link takes
(alpha-beta per link; a capped inter-host cable such as tc tbf's 10 Mbit/s is one number), what each
scheme costs or saves in memory, and the search over --dp-shard S and the ZeRO++ switches.

    bytes    (inside, across) per rank per step: formulas.dp_comm_bytes / hybrid_comm_bytes /
             zeropp_comm_bytes over the engine's padded buffers (built on meta, as --dry-run), and
             onebit.wire_bytes after 1-bit Adam's warm-up; a ring spanning hosts counts as across
    seconds  comm = k_in alpha_in + B_in / bw_in + k_x alpha_x + H B_x / bw_x
             (H: the ranks of a host, whose across bytes share its cable; k: ring steps)
    step     compute (an input: measured, or the planner's) + comm    (nothing overlapped)
    memory   the planner's params + grads + optimizer of one rank (over ZeRO's shards: S under
             hybrid sharding) + hpZ's secondary copy P/S B_param + 1-bit's errors 4 (n_pad + n_pad/N)
    choice   among the schemes within SLACK of the fastest step: the least memory, exact before
             lossy -- a fast link ties them all (plain sharding holds least), a slow one does not
Left out: gloo's framing and TCP/IP headers, CPU contention between ranks and with the compute,
the quantizers' own time, overlap of communication with compute.

    python -m nanomega.tools.cost_link --host 1 --across-mbit 10 --compute-s 2.5 -- \
        --world 2 --optimizer onebit                   # one configuration's predicted step
    python -m nanomega.tools.cost_link --host 2 --across-mbit 10 --search -- --world 4 --zero 3
Lesson: lessons/17-communication-compression.md
"""

import argparse
from dataclasses import dataclass

from nanomega import compose, formulas, meta, onebit
from nanomega.job import checks, flags
from nanomega.tools import preflight

SLACK = 0.05  # steps within 5% of the fastest count as equally fast


@dataclass(frozen=True)
class Network:
    """host: dp ranks per host; bandwidths in bytes/s (inside: a rank's link to its host's ranks;
    across: one host's cable to the others, shared by its ranks); alphas: seconds per message.
    The defaults are assumed round numbers (a loopback and a 1 Gbit/s Ethernet), not measured."""

    host: int
    inside_bw: float = 2e9
    across_bw: float = 1.25e8
    inside_alpha: float = 2e-5
    across_alpha: float = 1e-4

    @classmethod
    def capped(cls, host, mbit, **kw):
        """The cable capped at `mbit` Mbit/s (tc tbf's rate): 1e6 mbit / 8 bytes per second."""
        return cls(host, across_bw=mbit * 1e6 / 8, **kw)


@dataclass(frozen=True)
class Scheme:
    """One data-parallel configuration: ZeRO stage, shard group S (0: all of dp; with ZeRO++ the
    host size), ZeRO++'s qwz / qgz bits and hpz, and 1-bit Adam (stage 0)."""

    zero: int = 3
    shard: int = 0
    qwz: int = 0
    hpz: bool = False
    qgz: int = 0
    onebit: bool = False

    @classmethod
    def of(cls, config):
        """The scheme a checked train.py Config runs."""
        shard = config.dp_shard if config.dp_shard != config.dp else 0
        qwz, hpz, qgz = config.zeropp_qwz, config.zeropp_hpz, config.zeropp_qgz
        return cls(config.zero, shard, qwz, hpz, qgz, config.optimizer == "onebit")

    @property
    def zeropp(self):
        return bool(self.qwz or self.hpz or self.qgz)

    @property
    def lossy(self):
        """Compressors on: each a source of rounding the uncompressed run does not have."""
        return bool(self.qwz) + bool(self.qgz) + self.onebit

    def flags(self):
        """The train.py flags of this scheme."""
        out = ["--zero", str(self.zero)] + (["--dp-shard", str(self.shard)] if self.shard else [])
        out += ["--zeropp-qwz", str(self.qwz)] if self.qwz else []
        out += ["--zeropp-qgz", str(self.qgz)] if self.qgz else []
        out += ["--zeropp-hpz"] if self.hpz else []
        return out + (["--optimizer", "onebit"] if self.onebit else [])

    def name(self):
        parts = [f"ZeRO-{self.zero}"] if not self.onebit else ["1-bit Adam"]
        parts += [f"S={self.shard}"] if self.shard else []
        parts += [f"qwZ{self.qwz}"] if self.qwz else []
        parts += ["hpZ"] if self.hpz else []
        parts += [f"qgZ{self.qgz}"] if self.qgz else []
        return " ".join(parts)


# ---- bytes and messages per link -----------------------------------------------------------------
def link_bytes(s, sizes, n, dp, host, param_bytes, m=1):
    """(inside, across) bytes one rank sends per step under scheme s: sizes the engine's padded
    groups, n the trained elements (1-bit Adam's momentum), dp ranks, host dp ranks per host, fp32
    gradients on the wire; 1-bit Adam after its warm-up (during it: ZeRO-0's all-reduce)."""
    total, shard = sum(sizes), s.shard or dp
    if s.onebit:
        inside, across = 0.0, onebit.wire_bytes(n, dp)
    elif s.zeropp:
        zpp = dict(qwz=s.qwz, hpz=s.hpz, qgz=s.qgz, m=m)
        inside, across = formulas.zeropp_comm_bytes(sizes, shard, dp // shard, param_bytes, **zpp)
    elif shard < dp:
        inside, across = formulas.hybrid_comm_bytes(
            total, s.zero, shard, dp // shard, 4, param_bytes, m
        )
    else:
        inside, across = 0.0, formulas.dp_comm_bytes(total, s.zero, dp, 4, param_bytes, m)
    return where(inside, across, shard if s.zeropp or shard < dp else dp, dp, host)


def where(inside, across, group, dp, host):
    """The formulas' inside/across named by the real hosts: one host holds all -> inside; a shard
    group wider than a host -> its bytes cross too."""
    if dp <= host:
        return inside + across, 0.0
    if group > host:
        return 0.0, inside + across
    return inside, across


def ring_steps(s, groups, dp, host, m=1):
    """(inside, across) message steps per step: a ring over n ranks takes n-1 per reduce-scatter or
    all-gather, 2(n-1) per all-reduce, for each of the engine's groups (1-bit Adam: one buffer)."""
    shard = s.shard or dp
    rep = dp // shard

    def zero_calls(stage, n):  # dp_comm_bytes' collectives: stage 0 an all-reduce, else RS + AG
        per = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage]
        return groups * per * (n - 1)

    if s.onebit:
        inside, across = 0, 2 * (dp - 1)
    elif s.zeropp:
        inside = groups * m * ((shard - 1) * s.hpz + (shard - 1) * bool(s.qgz))
        across = groups * m * ((dp - 1) * (2 - s.hpz) + ((rep - 1) if s.qgz else (dp - 1)))
    elif shard < dp:
        inside, across = zero_calls(s.zero, shard), groups * 2 * (rep - 1)
    else:
        inside, across = 0, zero_calls(s.zero, dp)
    return where(inside, across, shard if s.zeropp or shard < dp else dp, dp, host)


# ---- a priced scheme -----------------------------------------------------------------------------
@dataclass
class Price:
    scheme: Scheme
    inside: float  # bytes per rank per step
    across: float
    comm_s: float  # seconds of both links
    step_s: float  # compute + comm
    memory: float  # bytes per rank: state + extra
    extra: float  # hpZ's secondary copy, 1-bit's error buffers


def seconds(inside, across, steps, net):
    """Alpha-beta per link; the host's ranks share its cable (their across bytes add up on it)."""
    t_in = steps[0] * net.inside_alpha + inside / net.inside_bw
    t_x = steps[1] * net.across_alpha + net.host * across / net.across_bw
    return t_in + t_x


def extra_bytes(s, sizes, n, dp, param_bytes):
    """What the scheme holds beyond its ZeRO stage: hpZ's 1/S slice of every gathered unit, 1-bit
    Adam's worker error (n padded) and server error (its chunk), fp32."""
    if s.hpz:
        return sum(sizes) // s.shard * param_bytes
    if s.onebit:
        pad = onebit.padded(n, dp)
        return 4 * (pad + pad // dp)
    return 0


def price(s, sizes, n, dp, net, param_bytes, m=1, compute_s=0.0, state=0.0):
    """Scheme s on network net: bytes per link, seconds, memory (state: the planner's bytes)."""
    inside, across = link_bytes(s, sizes, n, dp, net.host, param_bytes, m)
    comm = seconds(inside, across, ring_steps(s, len(sizes), dp, net.host, m), net)
    extra = extra_bytes(s, sizes, n, dp, param_bytes)
    return Price(s, inside, across, comm, compute_s + comm, state + extra, extra)


# ---- from train.py's flags -----------------------------------------------------------------------
def build(argv):
    """One configuration (train.py flags with --world) built on meta as --dry-run builds it:
    (config, padded group sizes, trained elements, parameter bytes, planner's state bytes)."""
    config = checks.check(flags.parse([*argv, "--dry-run"]))
    grid = meta.PaperGrid(
        config.dp, config.pp, config.tp, 0, cp=config.cp, dp_shard=config.dp_shard
    )
    _, engine, _ = compose.build(config, grid)
    sizes = [g.padded for g in engine.groups]
    n = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    state = max(map(sum, preflight.rank_state_bytes(config)))
    return config, sizes, n, engine.groups[0].full.element_size(), state


def predict(argv, s, net, compute_s=0.0):
    """The Price of scheme s for train.py's flags argv (which give --world and the model)."""
    config, sizes, n, pb, state = build([*argv, *s.flags()])
    return price(s, sizes, n, config.dp, net, pb, config.grad_accum, compute_s, state)


def candidates(zero, dp, host):
    """Stage `zero` over all of dp, over shard groups S dividing the host (hybrid), ZeRO++'s
    switches with the host as S (stage 3), 1-bit Adam (stage 0): the checks refuse the rest."""
    out = [Scheme(zero)] + [Scheme(zero, S) for S in range(1, host + 1) if host % S == 0 < S < dp]
    if zero == 3 and 1 < host < dp:
        for qwz in (0, 8, 4):
            for hpz in (False, True):
                out += [Scheme(3, host, qwz, hpz, qgz) for qgz in (0, 8, 4) if qwz or hpz or qgz]
    return out + ([Scheme(0, onebit=True)] if zero == 0 else [])


def search(argv, zero, net, compute_s=0.0):
    """Every scheme that composes, priced: (ranked list, best). Refused ones are left out; the
    rank: step time, then within SLACK of the fastest the least memory, exact before lossy."""
    dp = checks.check(flags.parse([*argv, "--zero", str(zero), "--dry-run"])).dp
    priced = []
    for s in candidates(zero, dp, net.host):
        try:
            priced.append(predict(argv, s, net, compute_s))
        except ValueError:  # the trainer's one-line refusal: does not compose here
            continue
    return rank(priced)


def rank(priced):
    """(sorted by step time, the recommendation)."""
    fastest = min(p.step_s for p in priced)
    tied = [p for p in priced if p.step_s <= fastest * (1 + SLACK)]
    best = min(tied, key=lambda p: (p.memory, p.scheme.lossy, p.step_s))
    return sorted(priced, key=lambda p: p.step_s), best


# ---- command line --------------------------------------------------------------------------------
def row(p):
    return (
        f"{p.scheme.name():<26} {p.inside / 1e6:10.3f} {p.across / 1e6:10.3f} "
        f"{p.comm_s:9.3f} {p.step_s:9.3f} {p.memory / 1e6:10.3f} {p.extra / 1e6:9.3f}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", type=int, required=True, help="dp ranks per host")
    p.add_argument("--across-mbit", type=float, default=1000.0, help="host cable, Mbit/s")
    p.add_argument("--inside-gbyte", type=float, default=2.0, help="inside a host, GB/s")
    p.add_argument("--across-alpha", type=float, default=1e-4, help="seconds per message")
    p.add_argument("--inside-alpha", type=float, default=2e-5, help="seconds per message")
    p.add_argument("--compute-s", type=float, default=0.0, help="the step without communication")
    p.add_argument("--search", action="store_true", help="every scheme at the stage of --zero")
    p.add_argument("train", nargs="*", help="train.py's flags (after --): --world, model, ...")
    a = p.parse_args(argv)
    bw = (a.inside_gbyte * 1e9, a.across_mbit * 1e6 / 8)
    net = Network(a.host, *bw, a.inside_alpha, a.across_alpha)
    config = checks.check(flags.parse([*a.train, "--dry-run"]))
    print(
        f"dp {config.dp}, {a.host} per host, cable {a.across_mbit:g} Mbit/s, compute {a.compute_s} s"
        f"\n{'scheme':<26} {'inside MB':>10} {'across MB':>10} {'comm s':>9} {'step s':>9} "
        f"{'memory MB':>10} {'extra MB':>9}"
    )
    if not a.search:
        print(row(predict(a.train, Scheme.of(config), net, a.compute_s)))
        return
    ranked, best = search(a.train, config.zero, net, a.compute_s)
    for q in ranked:
        print(row(q) + ("  <- recommended" if q is best else ""))


if __name__ == "__main__":
    main()
