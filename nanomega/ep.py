"""Expert parallelism: experts spread over the ranks of grid.ep; tokens travel to their experts and
back (all-to-all).

Idea (GShard; Megatron-Core's alltoall token dispatcher): ep ranks of a data-parallel group hold
E/ep experts each (expert e on ep rank e // (E/ep)) and different tokens. After routing, each rank
    permutes     its kept (token, expert) assignments into expert order (a stable sort by expert id)
    counts       trades the rows per expert: an all-to-all of (ep, E/ep) int64 counts
    dispatch     sends rank r the rows of r's experts: all_to_all_single with uneven splits (gloo has no list form)
    computes     the rows it received, regrouped expert-major, one expert at a time (moe.py says why a loop)
    combine      sends the results back (the splits swapped), unpermutes them, each times its router weight
                 into its own row, and sums each token's k rows in choice order (no atomic adds on a GPU:
                 index_add's order of k >= 3 additions would vary)
The backward of an all-to-all is the all-to-all with the splits swapped (AllToAll).
Which group reduces which gradient (dist.layout: dp index d = e_out x ep + e):
    dense weights   every dp rank holds them: reduced over grid.dp (dp_cp under context parallelism)
    an expert       held by the dp/ep ranks with the same ep index (grid.edp); its gradient on one of them already
                    sums the contributions of the tokens of all ep ranks (the all-to-all's backward brought them),
                    so the sum over edp covers all dp ranks' tokens, and the mean over dp divides by dp = edp x ep
    the norm        an expert counted once: summed over ep (different experts), and over edp when ZeRO shards it
Bytes one rank sends per MoE layer and micro-batch (h hidden, 2 or 4 bytes per element, rows = its
kept assignments to experts of other ranks, R = the rows it receives): forward (rows + R) h B
(dispatch + combine), backward the same, + (ep - 1) E/ep 8 bytes of counts in forward
(formulas.moe_all_to_all_bytes).
Lesson: lessons/16-experts.md
"""

import torch

# A DualPipeV pair's hand-off (moe_overlap.run_pair sets both; nothing outside a pair): called
# right after an all-to-all was issued (the other micro-batch computes), and after its wait.
OVERLAP = {"issued": lambda: None, "waited": lambda: None}


def is_expert(name):
    """Whether the parameter `name` (its dense name) belongs to a routed expert: held by its ep rank
    only."""
    return ".experts." in f".{name}"


class AllToAll(torch.autograd.Function):
    """all_to_all_single over `axis` as a function of tensors: rows in_splits[i] to rank i,
    out_splits[i] from it. Issued without waiting; in a DualPipeV pair the other micro-batch
    computes before the wait (OVERLAP; outside a pair it returns at once)."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):  # (sum in_splits, h) -> (sum out_splits, h)
        ctx.axis, ctx.splits = axis, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits),) + x.shape[1:])
        return _overlapped(axis, out, x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        out = grad.new_empty((sum(in_splits),) + grad.shape[1:])
        return _overlapped(ctx.axis, out, grad, in_splits, out_splits), None, None, None


def _overlapped(axis, out, t, out_splits, in_splits):
    """The all-to-all issued, the other side of a DualPipeV pair run, then waited for."""
    out, work = axis.all_to_all(out, t.contiguous(), out_splits, in_splits, wait=False)
    OVERLAP["issued"]()
    if work is not None:
        work.wait()
    OVERLAP["waited"]()
    return out


def run_experts(rows, sizes, experts, first):
    """rows (n, h) grouped by expert, sizes[j] rows for expert first + j -> (n, h): one expert at a
    time."""
    return torch.cat([experts[str(first + j)](chunk) for j, chunk in enumerate(rows.split(sizes))])


def dispatch_combine(x, experts, weights, keep, modules, n_experts, ep=None):
    """sum_j weights[t, j] expert_{experts[t, j]}(x[t]) over the kept assignments. x (T, h);
    experts, weights, keep (T, k) (keep None: dropless); modules: the experts this rank holds, by
    global index; ep: their Axis. One host sync (the counts read once): a boolean mask, bincount or
    a second read would each wait for the GPU (issue 42 M5)."""
    T, k = experts.shape
    # (T k,): assignment a is token a // k's choice a % k; a dropped one goes to bucket E, after
    # every expert's
    slot = torch.arange(T * k, device=x.device)
    token = slot // k
    expert, weight = experts.reshape(-1), weights.reshape(-1)
    if keep is not None:
        expert = expert.masked_fill(~keep.reshape(-1), n_experts)

    # expert-major, token order inside: the same on every layout; the kept ones first
    order = torch.argsort(expert, stable=True)
    slot, token, expert, weight = slot[order], token[order], expert[order], weight[order]
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=x.device)
    counts.index_add_(0, expert, torch.ones_like(expert))  # (E + 1,) rows per expert, then dropped

    if ep is None or ep.size == 1:
        sizes = counts.tolist()[:-1]  # the host sync
        n = sum(sizes)  # kept assignments
        out = run_experts(x[token[:n]], sizes, modules, 0)  # x[token]'s backward scatter-adds
    else:
        n, out = exchange(x, token, counts[:-1], modules, ep)

    # combine: each weighted output into its assignment's own row (no two alike: no atomic adds on
    # a GPU), then each token's k rows summed in choice order: the same sum on every device
    weighted = out * weight[:n, None].to(out.dtype)  # (n, h)
    rows = x.new_zeros(T * k, x.shape[-1]).index_copy(0, slot[:n], weighted)  # (T k, h)
    return rows.view(T, k, -1).sum(1)  # (T, h)


def exchange(x, token, counts, modules, ep):
    """(kept rows n, their outputs): rows x[token[:n]] to their experts' ranks (counts (E,) per
    expert, expert-major), computed there, sent back in their order. Collective over the ep ranks.
    One host sync: this rank's counts and the ones it receives, read together."""
    local = counts.numel() // ep.size
    send = counts.view(ep.size, local)  # (ep, E/ep): rows for each expert of each rank
    recv = torch.empty_like(send)  # (ep, E/ep): rows each rank sends for each of my experts
    ep.all_to_all(recv, send)
    sent, received = torch.stack([send, recv]).tolist()  # the host sync
    in_splits, out_splits = [sum(r) for r in sent], [sum(r) for r in received]

    # the rows to their experts' ranks
    n = sum(in_splits)
    got = AllToAll.apply(x[token[:n]], ep, out_splits, in_splits)  # source-major, then my experts
    # expert-major: each received row labelled with its expert, sorted stably (source order kept)
    label = torch.arange(local, device=x.device).repeat(ep.size)  # (ep E/ep,)
    label = label.repeat_interleave(recv.flatten(), output_size=sum(out_splits))
    regroup = torch.argsort(label, stable=True)

    sizes = [sum(r[j] for r in received) for j in range(local)]
    out = run_experts(got[regroup], sizes, modules, ep.rank * local)  # expert-major
    back = torch.empty_like(out).index_copy(0, regroup, out)  # source-major again
    return n, AllToAll.apply(back, ep, in_splits, out_splits)


def apply_expert_parallel(model, ep):
    """Keep, in place, only the experts of ep rank ep.rank in every MoE layer (expert e on rank e //
    (E/ep)), and give the layers the axis their tokens travel on. Call after tensor parallelism, on
    the meta model."""
    for block in model.blocks.values():
        moe = block.mlp
        if not hasattr(moe, "experts"):
            continue
        local = moe.n_experts // ep.size
        for key in list(moe.experts.keys()):
            if int(key) // local != ep.rank:
                del moe.experts[key]
        moe.ep = ep
    return model


def check(n_experts, ep, dp):
    """One line for an expert-parallel layout that cannot run."""
    if ep > 1 and not n_experts:
        raise ValueError(f"--ep {ep} needs experts to spread: add --n-experts (a multiple of {ep})")
    if n_experts and n_experts % ep:
        raise ValueError(
            f"--ep {ep} does not divide --n-experts {n_experts}; each ep rank holds n_experts / ep"
        )
    if dp % ep:
        raise ValueError(
            f"--ep {ep} does not divide dp {dp} (world / (tp x pp)): ep is carved out of dp"
        )


def check_engine(experts, stage, offload):
    """One line for what the ZeRO engine does not do with experts (raised before any collective)."""
    if experts and stage == 3:
        raise ValueError(
            "--zero 3 with --n-experts: ZeRO-3's units are gathered over dp, the experts live on ep "
            "ranks; use --zero 0, 1 or 2"
        )
    if experts and offload:
        raise ValueError("--offload with --n-experts is not built; leave out --offload")


def replica_group(grid):
    """The routed experts' replica group, as zero_rules.Replicas' fields (the table above): held alike by
    the ranks of grid.edp, their mean also divided by ep (the sum covers every dp rank's tokens),
    other experts on the ep ranks (the norm and the finite check sum over ep); check_engine."""
    return dict(
        name="experts",
        axis=grid.edp,
        holds=is_expert,
        divide=grid.ep.size,
        across=grid.ep,
        check=lambda stage, offload: check_engine(True, stage, offload),
    )
