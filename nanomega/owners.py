"""Owner-compute: an update that needs a whole matrix (Muon's), on an engine sharding flat buffers.

ZeRO cuts a matrix anywhere: rank r steps the elements of the matrix in its slice [r S, (r+1) S) of
the flat buffer (flat.py). An element-wise optimizer needs nothing more; Muon's orthogonalization
needs the whole matrix. So each sharded matrix gets one owner among the replica group's N ranks,
the same on every rank (the largest matrix first, to the rank with the least work so far); per step
one all-to-all sends every piece of a matrix's input to its owner, the owner computes the matrix's
update whole, and a second all-to-all sends each rank the pieces of the updates it steps. A
tensor-parallel matrix is whole only over tp too: its owner's tp ranks all-gather their slices,
each computes the whole update and keeps its slice (tp.py's split rule).
    bytes sent by rank r per step (fp32, both all-to-alls), over the matrices M of the group:
        4 [ sum_{M not owned by r} |piece_r(M)|  +  sum_{M owned by r} (|M| - |piece_r(M)|) ]
    all ranks together: 8 sum_M (|M| - |piece_owner(M)|), about 8 (N-1)/N Psi_M
    gather-all instead (every rank all-gathers every matrix, computes every update): 4 (N-1) Psi_M,
    and N times the orthogonalization work; owner-compute sends 2/N of that
Lesson: lessons/04-data-parallel-and-zero.md
"""

import torch

from . import tp


def balance(sizes, n):
    """Owners of matrices of `sizes` on n ranks: greedy, largest first (ties: the earlier matrix),
    each to the least-loaded rank (ties: the lowest). -> (owner per matrix, load per rank)."""
    owner, load = [0] * len(sizes), [0] * n
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        r = min(range(n), key=lambda r: load[r])
        owner[j], load[r] = r, load[r] + sizes[j]
    return owner, load


def span(group, i, r):
    """Elements [a, b) of parameter i of flat group `group` in rank r's slice (a == b: none)."""
    o, n, s = group.offsets[i], group.sizes[i], group.shard_numel
    a, b = max(o, r * s), min(o + n, (r + 1) * s)
    return (a - o, b - o) if a < b else (0, 0)


class Owners:
    """Which rank computes each whole matrix of the sharded flat groups, and the exchange.

    replicas: [(axis, flat groups)] (zero.ZeroEngine's replica groups); pieces: the engine's Pieces;
    whole(name) -> the optimizer's param group of a parameter needing its whole matrix, or None."""

    def __init__(self, replicas, pieces, whole, tp=None):
        self.tp = tp  # tensor-parallel matrices: gathered over it, computed whole, sliced back
        self.piece = {
            id(p.master): p for p in pieces if p.group is not None and whole(p.name) is not None
        }
        self.plans = []  # (axis, [(group, index, param group)], owner per matrix, load per rank)
        for axis, groups in replicas:
            mats = [
                (g, i, whole(k))
                for g in groups
                if g.split
                for i, k in enumerate(g.names)
                if whole(k) is not None
            ]
            if mats:
                owner, load = balance([g.sizes[i] for g, i, _ in mats], axis.size)
                self.plans.append((axis, mats, owner, load))

    def holds(self, p):
        """Whether p (an optimizer parameter) is a piece of a matrix this exchange computes."""
        return id(p) in self.piece

    def table(self):
        """The owners' load: elements orthogonalized per rank, per replica axis."""
        return "\n".join(
            f"owners over {axis.name} ({len(mats)} matrices): elements per rank {load}, "
            f"max/mean {max(load) * len(load) / max(sum(load), 1):.3f}"
            for axis, mats, _, load in self.plans
        )

    def bytes_sent(self, rank=None):
        """The formula: bytes this rank (of each plan's axis) sends in one exchange (fp32)."""
        total = 0
        for axis, mats, owner, _ in self.plans:
            r = axis.rank if rank is None else rank
            for (g, i, _), o in zip(mats, owner):
                a, b = span(g, i, r)
                total += 4 * ((b - a) if o != r else g.sizes[i] - (b - a))
        return total

    def exchange(self, items, compute):
        """items: [(param group, piece p, its input u)] for this rank's pieces; compute(whole input
        shaped like the (tp-local) matrix, param group) -> its whole update. -> {id(p): p's
        piece of its update}."""
        compute, out = self.whole_over_tp(compute), {}
        for group, p, u in items:  # matrices held whole here (stage 0, a world of one): no exchange
            piece = self.piece[id(p)]
            if not piece.group.split:
                matrix = (piece.name, piece.group.params[piece.index])
                out[id(p)] = compute(u.view(piece.shape), group, matrix)
        items = [(group, p, u) for group, p, u in items if self.piece[id(p)].group.split]
        mine = {(id(self.piece[id(p)].group), self.piece[id(p)].index): u for _, p, u in items}
        pieces = {(id(self.piece[id(p)].group), self.piece[id(p)].index): p for _, p, u in items}
        for axis, mats, owner, _ in self.plans:
            n, me = axis.size, axis.rank
            device = next(g.master.device for g, _, _ in mats)
            if device.type == "meta":  # a dry run (meta.PaperGrid): shapes only, no collective
                out.update({id(p): torch.empty_like(p) for (g, i), p in pieces.items()})
                continue

            # the inputs' pieces to their owners: to rank d, its matrices' pieces held here
            send = [[] for _ in range(n)]
            for (g, i, _), o in zip(mats, owner):
                if (id(g), i) in mine:
                    send[o].append(mine[id(g), i].reshape(-1))
            held = [
                sum(self.size(g, i, s) for (g, i, _), o in zip(mats, owner) if o == me)
                for s in range(n)
            ]
            got = self.all_to_all(axis, send, held, device)

            # each owned matrix whole, from its pieces in rank order; its update
            back = [[] for _ in range(n)]
            offsets = [0] * n
            for (g, i, group), o in zip(mats, owner):
                if o != me:
                    continue
                parts = []
                for s in range(n):
                    a, b = span(g, i, s)
                    parts.append(got[s][offsets[s] : offsets[s] + b - a])
                    offsets[s] += b - a
                whole = torch.cat(parts).view(g.shapes[i])
                update = compute(whole, group, (g.names[i], g.params[i])).reshape(-1)
                for s in range(n):
                    a, b = span(g, i, s)
                    if b > a:
                        back[s].append(update[a:b])

            # the updates' pieces back to the ranks stepping them
            mine_of = [
                sum(self.size(g, i, me) for (g, i, _), o in zip(mats, owner) if o == s)
                for s in range(n)
            ]
            got = self.all_to_all(axis, back, mine_of, device)
            offsets = [0] * n
            for (g, i, _), o in zip(mats, owner):
                a, b = span(g, i, me)
                if b > a:
                    out[id(pieces[id(g), i])] = got[o][offsets[o] : offsets[o] + b - a]
                    offsets[o] += b - a
        return out

    def whole_over_tp(self, compute):
        """compute(u, group) made compute(u, group, (name, param)): a tensor-parallel
        matrix's input all-gathered over tp (every tp rank of its owner), joined (tp.unshard_param),
        computed whole on each, and this rank's slice of the update kept (tp.shard_param)."""

        def on_matrix(u, group, matrix):
            name, param = matrix
            if (
                self.tp is None
                or self.tp.size == 1
                or not tp.is_tensor_parallel(param)
                or u.is_meta
            ):
                return compute(u, group)
            shards = torch.empty((self.tp.size, *u.shape), dtype=u.dtype, device=u.device)
            self.tp.all_gather(shards.view(-1), u.contiguous().view(-1))
            update = compute(tp.unshard_param(name, list(shards)).contiguous(), group)
            return tp.shard_param(name, update, self.tp.rank, self.tp.size).contiguous()

        return on_matrix

    @staticmethod
    def size(group, i, r):
        """Elements of parameter i of `group` in rank r's slice."""
        a, b = span(group, i, r)
        return b - a

    @staticmethod
    def all_to_all(axis, send, recv_sizes, device):
        """One all-to-all of fp32 pieces: send[d] (a list of 1-D tensors) to rank d; -> the 1-D
        block received from each rank, recv_sizes[s] elements from rank s."""
        in_splits = [sum(t.numel() for t in ts) for ts in send]
        flat = [t for ts in send for t in ts]
        t = torch.cat(flat) if flat else torch.zeros(0, device=device)
        received = torch.empty(sum(recv_sizes), device=device)
        axis.all_to_all(received, t, recv_sizes, in_splits)
        return list(torch.split(received, recv_sizes))
