"""DualPipeV: the V placement's schedule with overlapped forward-and-backward pairs, as data.

Idea (DeepSeek-V3 technical report, sec. 3.2.1, DualPipe; DualPipeV is its "cut-in-half" V form,
Sea AI Lab's, as in DeepSeek's open DualPipe repository): two model chunks per rank in a V (rank r
holds virtual stages r and 2p - 1 - r, schedules.PLACEMENT "v"). After a warm-up the steady state
runs pairs: the forward of one micro-batch on one chunk with the full backward (B then W) of
another on the other chunk. In a pair the two micro-batches' compute and communication overlap:
one micro-batch's MoE all-to-all runs while the other computes (moe_overlap.py gives that order).
Some backwards are split (B now, W later, wgrad.py) so their W fill the ramps, as in ZB-V.

`rounds(p, rank, m)` returns the rank's ops as rounds of (kind, mb, chunk); a round of three ops
(F, B, W of two micro-batches) is an overlapped pair, any other round one op. schedules.py turns
them into Ops (its "dualpipev" row); its simulator proves the plan deadlock-free.

Formulas (p ranks, 2p stages, m >= 2p micro-batches; F a chunk's forward, B its full backward, W
its weight-gradient part, F&B an overlapped pair), DualPipe repository's table (PP = 2p stages):
    bubble per rank      (PP/2 - 1)(F&B + B - 3W) = (p - 1)(F&B + B - 3W)
    activations          PP + 1 = 2p + 1 chunk micro-batches per rank (1F1B on 2p ranks: 2p)
    parameters           2x a 2p-rank pipeline's stage (two chunks)
Lesson: lessons/08-pipeline-parallel.md
"""

NAME = "dualpipev"


def check(pp, microbatches):
    """One-line refusal of what DualPipeV cannot run (its warm-up alone is 2p forwards)."""
    if pp < 2 or microbatches < 2 * pp:
        raise ValueError(
            f"--schedule {NAME} needs --pp >= 2 and at least 2 x pp micro-batches (its warm-up "
            f"fills both legs of the V), got pp {pp}, {microbatches} micro-batches: use "
            f"--grad-accum >= {2 * max(pp, 2)}"
        )


def rounds(p, rank, m):
    """Rank `rank`'s rounds, the order of DeepSeek's DualPipeV.step (rewritten): chunk 0 runs
    down the ranks, chunk 1 back up; each chunk's micro-batches in order, its deferred W first in
    first out."""
    check(p, m)
    out, done, stash = [], {(k, c): 0 for k in "FB" for c in (0, 1)}, []

    def f(c):  # the forward of chunk c's next micro-batch
        done[("F", c)] += 1
        return [("F", done[("F", c)] - 1, c)]

    def b(c, split=False):  # its backward: B with W at once, or W deferred (a later w())
        done[("B", c)] += 1
        mb = done[("B", c)] - 1
        if split:
            stash.append((mb, c))
            return [("B", mb, c)]
        return [("B", mb, c), ("W", mb, c)]

    def w():  # the oldest deferred weight gradient
        mb, c = stash.pop(0)
        return [("W", mb, c)]

    def run(*ops):  # one op a round
        out.extend([op] for op in ops)

    # 1-3. warm-up: 2(p - r - 1) forwards of chunk 0, r + 1 pairs F0 F1, p - r - 1 of B1 W1 F1
    for _ in range(2 * (p - rank - 1)):
        run(*f(0))
    for _ in range(rank + 1):
        run(*f(0), *f(1))
    for _ in range(p - rank - 1):
        run(*b(1, split=True), *w(), *f(1))

    # 4. steady state: overlapped pairs, F0 with B1 then F1 with B0 (the last rank's first F0
    #    and B1 run one after the other, as in DeepSeek's code)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            run(*f(0), *b(1))
        else:
            out.append(f(0) + b(1))
        out.append(f(1) + b(0))

    # 5-8. cool-down: p - r - 1 of B1 with a pair F1 B0; r + 1 of B1 B0 (split from the middle);
    #      p - r - 1 of W B0 (split); the deferred W
    for _ in range(p - rank - 1):
        run(*b(1))
        out.append(f(1) + b(0))
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        run(*b(1, split))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        run(*b(0, split))
    for _ in range(p - rank - 1):
        run(*w(), *b(0, split=True))
    while stash:
        run(*w())
    return out


def pairs(rounds_):
    """The overlapped pairs of a rank's rounds: [(the forward, the backward)]."""
    return [(rnd[0], rnd[1]) for rnd in rounds_ if len(rnd) == 3]
