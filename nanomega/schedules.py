"""Pipeline schedules as pure op lists, the p2p plan they imply, the timeline and bubble they give.

A schedule is the order in which one pipeline rank runs forwards F(mb) and backwards B(mb) of its
micro-batches, cut into rounds (ops that run back to back; p2p happens between rounds). Everything
else follows from it: what each op must receive first and send after (`comm_plan`; on ZB-V's V,
`timed_plan`), whether the ranks can deadlock, and how long they sit idle (`simulate`). No torch,
no processes: pp.py runs the very same plan with real tensors (timeline.py draws it).

Formulas (p stages, m micro-batches, v virtual stages per rank, forward t_f and backward t_b per
          stage; split backward: B the input gradient t_b, W the weight gradient t_w):
    GPipe, 1F1B:        step time (m + p - 1)(t_f + t_b),    bubble = (p - 1) / (m + p - 1)
    interleaved 1F1B:   each chunk is 1/v of a stage,        bubble = (p - 1) / (v m + p - 1)
    micro-batches alive on rank r: GPipe m, 1F1B min(m, p - r)  (activation memory ∝ m vs ∝ p)
    ZB-H1 (Qi et al. 2024, Table 1): idle per rank (p - 1)(t_f + t_b - t_w), vs 1F1B's
                        (p - 1)(t_f + t_b + t_w); alive min(m, p) on every rank (1F1B's peak)
    ZB-H2 (Qi et al. 2024, Table 1): idle per rank (p - 1)(t_f + t_b - 2 t_w) from its first op
                        to its last (m >= 2p - 1); alive 2p - 1 (the paper's (2p - 1) M_B); the
                        ranks' spans are offset by t_f, so a synchronized step adds (p - 1) t_f
    ZB-V (Qi et al. 2024, sec. 6): two chunks per rank in a V (t_f = t_b = t_w = t per chunk),
                        idle per rank (p - 1) t for m >= 2p - 1 (the V's ramp; ours, from the
                        schedule: tests/test_zb_v.py), vs 1F1B's 6(p - 1) t; alive 2p chunks on
                        every rank (the paper's p M_B, 1F1B's peak)
Lesson: lessons/08-pipeline-parallel.md
"""

import contextlib
import time
from collections import namedtuple

from . import dualpipe

# kind "F", "B" (the input gradient; with no W, the whole backward) or "W" (the weight gradients);
# chunk = model chunk on this rank
Op = namedtuple("Op", "kind mb chunk", defaults=(0,))
Comm = namedtuple("Comm", "sends recvs")  # one batched isend/irecv: lists of messages
# A message is ("F", mb, vs): the activation virtual stage vs sends to vs + 1, or ("B", mb, vs): the
# gradient vs sends to vs - 1. Which rank holds virtual stage vs: the placement (below).
Event = namedtuple("Event", "op mb start end chunk")

# Where each virtual stage lives. "loop" (Megatron's interleaved; v = 1 is plain 1F1B): chunk c of
# rank r is virtual stage c p + r, the last (head and loss) on rank p - 1. "v" (ZB-V): two chunks
# down and back up, rank r holds r and 2p - 1 - r, so the first and the last stage (embedding; head
# and loss) are both on rank 0 and the turn p - 1 -> p stays on rank p - 1 (no message).
PLACEMENT = {"zb-v": "v", "dualpipev": "v"}  # a schedule not listed: "loop"


def placement(schedule):
    """The placement a schedule (its name) runs on."""
    return PLACEMENT.get(schedule, "loop")


def virtual_stage(p, rank, chunk, place="loop"):
    """The virtual stage that chunk `chunk` of rank `rank` is."""
    return 2 * p - 1 - rank if place == "v" and chunk == 1 else chunk * p + rank


def stage_rank(vs, p, place="loop"):
    """The rank holding virtual stage vs (the inverse of virtual_stage)."""
    return 2 * p - 1 - vs if place == "v" and vs >= p else vs % p


def gpipe(p, rank, m, v=1):
    """GPipe (Huang et al. 2019): all forwards, then all backwards."""
    return [[Op("F", i)] for i in range(m)] + [[Op("B", i)] for i in range(m)]


def one_f_one_b(p, rank, m, v=1):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): only p - rank - 1 forwards run ahead
    of the backwards."""
    fwd, bwd = [Op("F", i) for i in range(m)], [Op("B", i) for i in range(m)]
    return _warmup_steady_cooldown(fwd, bwd, warmup=min(p - rank - 1, m), pair=False)


def interleaved_1f1b(p, rank, m, v):
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): v model chunks per rank;
    micro-batches go through the chunks in groups of p (needs m % p == 0); backwards visit the
    chunks in reverse order."""
    order = _chunk_order(p, m, v)
    fwd = [Op("F", mb, c) for mb, c in order]
    bwd = [Op("B", mb, v - 1 - c) for mb, c in order]
    return _warmup_steady_cooldown(
        fwd, bwd, warmup=min(2 * (p - rank - 1) + (v - 1) * p, m * v), pair=True
    )


def _warmup_steady_cooldown(fwd, bwd, warmup, pair):
    """Rounds of ops that run back to back; p2p happens only between rounds. In the interleaved
    steady state a forward and a backward form one round (their four messages share one batched
    call, as Megatron's send_forward_backward_recv_forward_backward): sending after each op
    deadlocks the ring of chunks."""
    steady = [[f, b] for f, b in zip(fwd[warmup:], bwd)]
    if not pair:
        steady = [[op] for rnd in steady for op in rnd]
    return (
        [[f] for f in fwd[:warmup]]  # warm-up: fill the pipeline
        # steady state: one forward, one backward
        + steady
        # cool-down: drain the remaining backwards
        + [[b] for b in bwd[len(fwd) - warmup :]]
    )


def zb_h1(p, rank, m, v=1):
    """ZB-H1 (Qi et al. 2024, sec. 3.1, Fig. 3): 1F1B's forwards and input-gradient backwards B;
    each rank runs its weight-gradient passes W `rank` B's late, so they fill what would be its
    wait for the cool-down's gradients (the last rank, which waits longest, delays most)."""
    return _split_1f1b(m, warmup=min(p - rank - 1, m), lag=rank, f_first=True)


def zb_h2(p, rank, m, v=1):
    """ZB-H2 (Qi et al. 2024, sec. 3.1, Fig. 3; our reading of it): 2(p - rank) - 1 warm-up
    forwards fill the wait for the first gradient, then B W F; each rank runs its W's 2 rank B's
    late, which leaves 2 rank + 1 W's for the tail: every rank is busy from its first op to its
    last (a parallelogram). Zero bubble needs the next step's forwards to start while the last
    rank finishes, i.e. the optimizer step's synchronization bypassed (the paper's sec. 4):
    --post-validate (post_validate.py); without it the step waits for every rank (lessons/08)."""
    return _split_1f1b(m, warmup=min(2 * (p - rank) - 1, m), lag=2 * rank, f_first=False)


def _split_1f1b(m, warmup, lag, f_first):
    """One chunk, a split backward: `warmup` forwards; then per micro-batch b its B, the W `lag`
    B's behind, and the next forward (before B when f_first); the W's left at the end."""
    ops, w = [Op("F", i) for i in range(warmup)], 0
    for b in range(m):
        f = [Op("F", warmup + b)] if warmup + b < m else []
        ops += f if f_first else []
        ops.append(Op("B", b))
        if b + 1 - w > lag:  # W of the oldest micro-batch, `lag` B's behind
            ops.append(Op("W", w))
            w += 1
        ops += [] if f_first else f
    return [[op] for op in ops + [Op("W", i) for i in range(w, m)]]


def zb_v(p, rank, m, v=2):
    """ZB-V (Qi et al. 2024, sec. 6), on the V placement: chunk 0 runs down the ranks,
    chunk 1 back up. Warm-up: 2(p - rank) - 1 forwards of chunk 0, `rank` pairs F1 F0, then
    p - rank triples F1 B1 W1 of chunk 1; steady state: F0 B0 W0 F1 B1 W1; cool-down: `rank`
    pairs B0 B1, p - rank pairs B0 W0, the W left. Laid out for n = max(m, 2p - 1) micro-batches
    (the warm-up's length), the ops of micro-batches >= m dropped (as PyTorch's
    ScheduleZBVZeroBubble)."""
    n, ops, done = max(m, 2 * p - 1), [], {(k, c): 0 for k in "FBW" for c in (0, 1)}

    def run(*ops_):  # ("F", 0), ...: each chunk's next micro-batch of that kind
        for kind, chunk in ops_:
            ops.append(Op(kind, done[(kind, chunk)], chunk))
            done[(kind, chunk)] += 1

    # warm-up: fill both legs of the V
    run(*[("F", 0)] * (2 * (p - rank) - 1))
    run(*[("F", 1), ("F", 0)] * rank)
    run(*[("F", 1), ("B", 1), ("W", 1)] * (p - rank))

    # steady state: a forward, an input gradient and a weight gradient of each chunk
    while done[("F", 1)] < done[("F", 0)] or done[("F", 0)] < n:
        run(*[("F", 0)] * (done[("F", 0)] < n), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))

    # cool-down: the input gradients first, the weight gradients fill the wait
    run(*[("B", 0), ("B", 1)] * rank)
    run(*[("B", 0), ("W", 0)] * (p - rank))
    run(*[("W", 1)] * (done[("B", 1)] - done[("W", 1)]))
    run(*[("W", 0)] * (done[("B", 0)] - done[("W", 0)]))
    return [[op] for op in ops if op.mb < m]


def dualpipev(p, rank, m, v=2):
    """DualPipeV (dualpipe.py: its order; an overlapped pair is one round F, B, W) as Ops."""
    return [[Op(*op) for op in rnd] for rnd in dualpipe.rounds(p, rank, m)]


def forward_only(p, rank, m, v=1):
    """Evaluation: the forwards alone, in the interleaved order (any m: the last
    group takes the rest)."""
    return [[Op("F", mb, c)] for mb, c in _chunk_order(p, m, v)]


def _chunk_order(p, m, v):
    """(micro-batch, chunk) pairs: groups of p micro-batches, each group through
    chunk 0, then 1, ..."""
    n = max(m // p, 1)
    groups = [range(g * p, m if g == n - 1 else (g + 1) * p) for g in range(n)]
    return [(mb, c) for group in groups for c in range(v) for mb in group]


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}
SPLIT = {
    "zb-h1",
    "zb-h2",
    "zb-v",
    "dualpipev",
}  # schedules with W ops: the backward split (wgrad.py)
# p2p by timed_plan besides the V: a rank's warm-up runs ahead of what its neighbour takes
TIMED = {"zb-h2"}


def ops_in_order(rounds):
    """Every op of a schedule in the order the rank runs it, the rounds' boundaries dropped."""
    return [op for rnd in rounds for op in rnd]


def recv_msg(op, p, rank, v, place="loop"):
    """The message op needs before it can run: the input activation (F) or the output gradient
    (B); a weight-gradient op W needs none."""
    vs = virtual_stage(p, rank, op.chunk, place)
    if op.kind == "W":
        return None
    if op.kind == "F":
        return ("F", op.mb, vs - 1) if vs > 0 else None
    return ("B", op.mb, vs + 1) if vs < p * v - 1 else None


def send_msg(op, p, rank, v, place="loop"):
    """The message op produces: its output activation (F) or its input gradient (B); W none."""
    vs = virtual_stage(p, rank, op.chunk, place)
    if op.kind == "W":
        return None
    if op.kind == "F":
        return ("F", op.mb, vs) if vs < p * v - 1 else None
    return ("B", op.mb, vs) if vs > 0 else None


def peer(msg, p, rank, place="loop"):
    """The rank at the other end of msg, seen from rank (rank itself: a message that stays, the
    V's turn)."""
    kind, _, vs = msg
    src, dst = stage_rank(vs, p, place), stage_rank(vs + (1 if kind == "F" else -1), p, place)
    return dst if src == rank else src


def comm_plan(rounds, p, rank, v=1, place="loop"):
    """Ops with batched p2p calls between them: after a round, one call sends what it produced and
    receives what the next round needing anything needs (Megatron's send_forward_recv_backward
    pattern), so that two neighbours never both wait on a message the other has not posted. Rounds
    that need nothing (a W) run while that call is in flight. A message that stays on this rank
    (the V's turn) is in no call."""

    def remote(msgs):
        return [msg for msg in msgs if msg and peer(msg, p, rank, place) != rank]

    needs = [remote(recv_msg(op, p, rank, v, place) for op in rnd) for rnd in rounds]
    sends = [remote(send_msg(op, p, rank, v, place) for op in rnd) for rnd in rounds]
    steps, requested = [], set()
    for i, rnd in enumerate(rounds):
        if not requested.issuperset(needs[i]):
            steps.append(Comm([], needs[i]))
        steps += rnd
        if not sends[i]:
            continue
        ahead = []  # the receives of the next round that needs any, unless a round sends first
        for j in range(i + 1, len(rounds)):
            if needs[j] or sends[j]:
                ahead = needs[j]
                break
        requested.update(ahead)
        steps.append(Comm(sends[i], ahead))
    return steps


def rank_plan(make, p, rank, m, v=1, place="loop", timed=False):
    """Rank `rank`'s steps: its schedule's (make's) ops and the p2p calls between them: comm_plan,
    or on the V and when timed (the TIMED schedules) timed_plan."""
    if place == "v" or timed:
        return timed_plan(make, p, rank, m, v, place)
    return comm_plan(make(p, rank, m, v), p, rank, v, place)


def timed_plan(make, p, rank, m, v, place):
    """The V's p2p calls. There each pair of neighbours carries two streams each way (chunk 0's
    activations and chunk 1's gradients down, the others up) that the two ranks need in different
    orders, so a call per round (comm_plan) would match messages out of order or deadlock. Instead
    every round gets its time on a unit clock with free messages (the dataflow of all ranks' op
    lists; a round of several ops, DualPipeV's overlapped pair, starts once all its inputs are
    made and sends after its last op), and at each tick t a rank posts one call: what it made at
    t, and what its peers made for it at t. Both ends of a message post it at the same tick, so
    every pair agrees on the order and the calls of tick t complete once every rank has run its ops
    before t: no deadlock. ZB-H2
    (TIMED) too: there comm_plan's warm-up sends would wait for a neighbour that runs fewer
    warm-up forwards to post their receives, and the sender would idle."""
    rounds = [make(p, r, m, v) for r in range(p)]
    ops = [ops_in_order(rs) for rs in rounds]
    made, start, clock, pos, n, progress = {}, {}, [0] * p, [0] * p, [0] * p, True
    while progress:  # each rank runs its rounds in order as soon as all their inputs are made
        progress = False
        for r in range(p):
            while pos[r] < len(rounds[r]):
                rnd = rounds[r][pos[r]]
                needs = [msg for op in rnd if (msg := recv_msg(op, p, r, v, place))]
                if any(msg not in made for msg in needs):
                    break
                t = max([clock[r]] + [made[msg][0] for msg in needs])
                clock[r] = t + len(rnd)  # a round's ops run back to back, its sends after it
                for i, op in enumerate(rnd, start=n[r]):
                    start[(r, i)] = t
                    out = send_msg(op, p, r, v, place)
                    if out:
                        made[out] = (clock[r], r, i)  # (tick, sender, its op index): the order
                pos[r], n[r], progress = pos[r] + 1, n[r] + len(rnd), True
    stuck = [r for r in range(p) if pos[r] < len(rounds[r])]
    if stuck:
        raise RuntimeError(
            f"p={p} m={m} v={v} ({place}) deadlocks: ranks {stuck} wait at "
            f"{[rounds[r][pos[r]] for r in stuck]} for inputs no op makes before them"
        )

    # one call per tick at which this rank sends or receives, before the op that starts there
    ticks = {}
    for msg, (t, src, _) in sorted(made.items(), key=lambda item: item[1]):
        if rank in (src, peer(msg, p, src, place)) and peer(msg, p, src, place) != src:
            sends, recvs = ticks.setdefault(t, ([], []))
            (sends if src == rank else recvs).append(msg)
    steps = []
    for i, op in enumerate(ops[rank]):
        steps += [Comm(*ticks.pop(t)) for t in sorted(ticks) if t <= start[(rank, i)]]
        steps.append(op)
    return steps + [Comm(*ticks.pop(t)) for t in sorted(ticks)]


def simulate(p, m, schedule, v=1, t_f=1, t_b=2, t_w=0, place=None, timed=None):
    """Run every rank's plan on a unit clock: F takes t_f, B t_b (a backward is ~2 forwards of
    FLOPs; with W ops, B is the input gradient alone and W the weight gradients), messages take no
    time. A batched call completes only when every peer has posted the matching call (the
    strictest, NCCL-like rendezvous); the rank waits for it there, or (a plan with W ops, whose W
    run while calls are in flight) goes on until an op needs one of its receives. A later call to
    the same peer waits for it (calls between two ranks complete in order). pp.py waits where this
    does; a plan that finishes here cannot deadlock. A message that stays on its rank (the V's
    turn) is there when the op that made it has run. place: the placement (default: the named
    schedule's; a schedule function runs on "loop" unless told); timed: p2p by timed_plan (default:
    whether the named schedule is in TIMED). Returns one Trace per rank."""
    # a name, or a schedule function
    make = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    place = place or (placement(schedule) if isinstance(schedule, str) else "loop")
    timed = schedule in TIMED if timed is None else timed
    plans = [rank_plan(make, p, r, m, v, place, timed) for r in range(p)]
    for r, plan in enumerate(plans):
        _check_op_order([s for s in plan if isinstance(s, Op)], r, m, v)
    _check_message_order(plans, p, place)

    pos, clock, posted = [0] * p, [0] * p, {}
    calls = [[] for _ in range(p)]  # per rank: [call, posted at] in posting order
    where, last = {}, {}  # (rank, message) -> its call; (rank, peer) -> the last call between them
    kept = {}  # a message that stays on its rank -> when the op that made it ended
    split = [any(isinstance(s, Op) and s.kind == "W" for s in plan) for plan in plans]
    waiting = [False] * p  # posted its current call, waits for it
    traces = [Trace(r) for r in range(p)]
    progress = True

    def done(r, k):  # when rank r's call k completed, or None while a peer has not posted
        call, start = calls[r][k]
        ends = [posted.get((msg, "recv")) for msg in call.sends]
        ends += [posted.get((msg, "send")) for msg in call.recvs]
        return None if None in ends else max([start] + ends)

    # each rank runs until a message blocks it; done when no rank can move
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                step = plans[r][pos[r]]
                if isinstance(step, Op):
                    msg = recv_msg(step, p, r, v, place)
                    k = where.get((r, msg))
                    if msg and peer(msg, p, r, place) == r:
                        if msg not in kept:
                            break  # made by a later op of its own: waits forever
                        start = max(clock[r], kept[msg])
                    elif msg and (k is None or done(r, k) is None):
                        break  # its input has not arrived
                    else:
                        start = max(clock[r], done(r, k)) if msg else clock[r]
                    dur = {"F": t_f, "B": t_b, "W": t_w}[step.kind]
                    traces[r].events.append(
                        Event(step.kind, step.mb, start, start + dur, step.chunk)
                    )
                    clock[r] = start + dur
                    out = send_msg(step, p, r, v, place)
                    if out and peer(out, p, r, place) == r:
                        kept[out] = clock[r]
                else:
                    if not waiting[r]:  # post the call
                        peers = {peer(msg, p, r, place) for msg in step.sends + step.recvs}
                        earlier = [done(r, last[(r, q)]) for q in peers if (r, q) in last]
                        if None in earlier:
                            break  # an earlier call to that peer is still in flight
                        start = max([clock[r]] + earlier)
                        posted.update({(msg, "send"): start for msg in step.sends})
                        posted.update({(msg, "recv"): start for msg in step.recvs})
                        calls[r].append((step, start))
                        where.update({(r, msg): len(calls[r]) - 1 for msg in step.recvs})
                        last.update({(r, q): len(calls[r]) - 1 for q in peers})
                        waiting[r] = not split[r]
                    if waiting[r]:  # without W ops the rank waits for each call as it posts it
                        if done(r, len(calls[r]) - 1) is None:
                            break
                        clock[r], waiting[r] = done(r, len(calls[r]) - 1), False
                pos[r] += 1
                progress = True

    stuck = [
        r
        for r in range(p)
        if pos[r] < len(plans[r]) or None in [done(r, k) for k in range(len(calls[r]))]
    ]
    if stuck:
        raise RuntimeError(
            f"{schedule} p={p} m={m} v={v} deadlocks: ranks {stuck} wait at "
            f"{[plans[r][pos[r]] if pos[r] < len(plans[r]) else 'the end' for r in stuck]}"
        )
    return traces


def _check_op_order(ops, rank, m, v):
    """Every micro-batch of every chunk runs F, then B, then (a split backward) W, once each."""
    kinds = "FBW" if any(op.kind == "W" for op in ops) else "FB"
    seen = {}
    for op in ops:
        done = seen.setdefault((op.chunk, op.mb), "")
        if kinds[len(done) : len(done) + 1] != op.kind:
            raise RuntimeError(f"rank {rank}: {op} after {done or 'nothing'} of its micro-batch")
        seen[(op.chunk, op.mb)] += op.kind
    if any(seen.get((c, mb)) != kinds for c in range(v) for mb in range(m)) and len(seen):
        if not all(done == "F" for done in seen.values()):  # forward_only: F alone
            raise RuntimeError(f"rank {rank}: not every micro-batch runs {kinds}")


def _check_message_order(plans, p, place):
    """p2p matches messages between two ranks in posting order: each ordered pair
    must agree on it."""
    sent, received = {}, {}
    for r, plan in enumerate(plans):
        for step in plan:
            if isinstance(step, Comm):
                for msg in step.sends:
                    sent.setdefault((r, peer(msg, p, r, place)), []).append(msg)
                for msg in step.recvs:
                    received.setdefault((peer(msg, p, r, place), r), []).append(msg)
    if sent != received:
        bad = next(k for k in set(sent) | set(received) if sent.get(k) != received.get(k))
        raise RuntimeError(
            f"ranks {bad} disagree on message order: {sent.get(bad)} vs {received.get(bad)}"
        )


class Trace:
    """One rank's ops as (op, micro-batch, start, end, chunk), plus the memory high-water marks of a
    step."""

    def __init__(self, rank):
        self.rank, self.events = rank, []
        self.peak_inflight = 0  # micro-batches whose forward ran and backward did not yet
        self.peak_output_bytes = 0  # bytes of sent stage outputs still held for their backward

    @contextlib.contextmanager
    def span(self, op, sync=lambda: None):
        """Time op (an Op) on the wall clock; sync waits for an accelerator's queued work first."""
        sync()
        start = time.perf_counter()
        yield
        sync()
        self.events.append(Event(op.kind, op.mb, start, time.perf_counter(), op.chunk))


def peak_inflight(trace):
    """Most micro-batches (per chunk) whose forward ran and whose backward's last op (W when the
    schedule splits it, else B) did not yet: the activations and the W inputs a rank holds."""
    split = any(e.op == "W" for e in trace.events)
    alive, peak = set(), 0
    for e in sorted(trace.events, key=lambda e: e.start):
        if e.op == "F":
            alive.add((e.chunk, e.mb))
        elif e.op == "W" or not split:
            alive.discard((e.chunk, e.mb))
        peak = max(peak, len(alive))
    return peak


def bubble_fraction(traces):
    """Idle share of the ranks' time between the first op's start and the last op's end."""
    events = [e for t in traces for e in t.events]
    span = max(e.end for e in events) - min(e.start for e in events)
    return 1.0 - sum(e.end - e.start for e in events) / (len(traces) * span)
