"""Resharding: a checkpoint saved under one layout loads under any other (DeepSpeed's universal
checkpoint, done on load).

Each rank saves its pieces *by name* (export_by_name: the element range of every parameter slice it
owns, its fp32 master values and optimizer state); nothing is gathered to save. Loading rebuilds
each full tensor from the pieces (tp.unshard_param) and keeps the rank's new slices (tp.shard_param,
import_by_name), reading only the shards whose pieces it needs, always to the CPU first. The files
themselves -- shards, manifest, checksums, discovery -- are nanomega/checkpoint.py.
Lesson: lessons/19-checkpoints-and-failures.md
"""

import copy as copy_module
import math
from collections import defaultdict

import torch

from nanomega import checkpoint, ep, pp, tp
from nanomega.flat import Piece
from nanomega.gpt_config import GPTConfig


def is_elementwise(v):
    """An optimizer state entry shaped like its parameter (Adam's m, v), as opposed to a
    scalar (its step)."""
    return torch.is_tensor(v) and v.dim() > 0


def clone(v):
    return v.clone() if torch.is_tensor(v) else copy_module.deepcopy(v)


def scalar(v, device=None):
    """A copy of a scalar state entry (Adam's step), on `device` when given."""
    return clone(v) if device is None or not torch.is_tensor(v) else v.to(device, copy=True)


def held(engine):
    """A Piece for every parameter slice this rank's zero.ZeroEngine holds: the stepped pieces, then
    frozen parameters (ZeRO-3: their shards; otherwise whole)."""
    out = [piece for piece in engine.pieces if piece.group is not None]
    frozen = engine.sharded.frozen if engine.sharded else []

    for g in frozen:
        out += [
            Piece(
                g.names[i],
                tuple(g.shapes[i]),
                a - g.offsets[i],
                b - g.offsets[i],
                g.shard[a - g.lo : b - g.lo],
                replica=False,
                group=g,
                index=i,
                at=a - g.lo,
            )
            for i, a, b in g.pieces()
        ]

    # frozen parameters held whole
    in_units = {id(p) for g in frozen for p in g.params}
    out += [
        Piece(k, tuple(p.shape), 0, p.numel(), p.detach().reshape(-1), replica=True)
        for k, p in engine.module.named_parameters()
        if not p.requires_grad and id(p) not in in_units
    ]
    return out


def export_by_name(engine, copies=False, copy=True):
    """This rank's share of every parameter by name: [dict(name, shape, start, end, master (fp32),
    state {key: 1-D slice, or the scalar})]. Over the job each parameter is exported once: dp
    replicas (dp rank > 0; a routed expert's: edp rank > 0) and the last pipeline stage's copy of
    the tied embedding export nothing, unless copies=True. copy=True: the masters and moments copied
    straight to host memory (a clone on the GPU first would need 12 more bytes per parameter there
    while the save lasts: issue 42 M3); copy=False: views of live buffers (fp32 models), to be
    copied before the next step."""
    out, grid = [], engine.grid
    take = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach())

    for piece in held(engine):
        if (
            not copies
            and piece.replica
            and (grid.edp.rank if ep.is_expert(piece.name) else grid.dp_cp.rank) != 0
        ):
            # one of the dp x cp replicas; a routed expert's are its edp ranks (dp
            # peers hold others: ep.py)
            continue

        p = piece.group.params[piece.index] if piece.group else None
        if not copies and p is not None and pp.is_shared_embedding_copy(p):
            continue
        if not copies and copy_across(engine, piece):
            continue

        state = engine.optimizer.state.get(piece.master, {})
        out.append(
            dict(
                name=piece.name,
                shape=piece.shape,
                start=piece.start,
                end=piece.end,
                master=take(piece.master.reshape(-1).float()),
                state={
                    k: take(v.reshape(-1)) if is_elementwise(v) else clone(v)
                    for k, v in state.items()
                },
            )
        )
    return out


def copy_across(engine, piece):
    """Hybrid sharding: whether this rank's slice is a copy of the one its peer at replicate index 0
    holds (and saves): the slices of a group sharded inside a host are the same in every host."""
    if piece.group is None:  # held whole: a dp_cp replica (export_by_name's first rule)
        return False
    rule = engine.rule.get(id(piece.group))  # ZeRO-3's frozen shards: the default group's
    across = rule.replicate if rule is not None else engine.replicate
    return across is not None and across.rank > 0


@torch.no_grad()
def import_by_name(engine, params_by_name, optim_state_by_name=None):
    """Keep this rank's slices of full tensors given by name (saved in any layout): the engine's
    fp32 masters, the model's parameters (frozen ones too) and, when given, the optimizer state."""
    missing = [k for k, _ in engine.module.named_parameters() if k not in params_by_name]
    if missing:
        raise ValueError(
            f"import_by_name: no tensor for parameters {missing[:3]} (of {len(missing)} missing)"
        )

    # the weights: the masters, the frozen shards, the frozen parameters held whole
    for g in engine.groups:
        g.master.copy_(g.flatten([params_by_name[k] for k in g.names], torch.float32)[g.lo : g.hi])
    for g in engine.sharded.frozen if engine.sharded else []:
        g.shard.copy_(g.flatten([params_by_name[k] for k in g.names])[g.lo : g.hi])
    for piece in held(engine):
        if piece.group is None:  # a frozen parameter held whole
            piece.master.copy_(params_by_name[piece.name].reshape(-1))

    # the optimizer state, by name
    if optim_state_by_name is not None:
        optimizer = engine.optimizer
        optimizer.state.clear()
        for piece in engine.pieces:
            m = piece.master
            if piece.group is None:  # an empty piece takes the keys of any parameter of its group
                j = next(
                    j for j, group in enumerate(optimizer.param_groups) if group["params"][0] is m
                )
                st = next(
                    (
                        optim_state_by_name[k]
                        for k, jj in engine.group_of.items()
                        if jj == j and optim_state_by_name.get(k)
                    ),
                    {},
                )
                optimizer.state[m] = {
                    k: m.new_zeros(0, dtype=v.dtype) if is_elementwise(v) else clone(v)
                    for k, v in st.items()
                }
                continue

            st = optim_state_by_name[piece.name]
            # element-wise state goes to the parameter's device at every stage (a checkpoint is read
            # to the CPU); scalars (Adam's step) where torch.optim keeps them: on the CPU, or beside
            # the parameter for a fused or capturable group (fused AdamW refuses a CPU step for a
            # CUDA parameter)
            group = optimizer.param_groups[engine.group_of[piece.name]]
            home = m.device if group.get("fused") or group.get("capturable") else None
            optimizer.state[m] = {
                k: (
                    v.to(m.device).reshape(-1)[piece.start : piece.end].clone().view(m.shape)
                    if is_elementwise(v)
                    else scalar(v, home)
                )
                for k, v in st.items()
            }

    engine.write_back()


def pieces(engine, grid, copy=True):
    """What this rank saves: its share of every parameter by name (export_by_name), with its tp rank
    (the pieces of tensor-parallel parameters are slices of the tp-local tensor). copy=False: views
    of the engine's live buffers, to be copied before the next step (async_checkpoint.AsyncSaver
    copies them into reused buffers)."""
    return dict(tp_rank=grid.tp_rank, pieces=export_by_name(engine, copy=copy))


def on_host(pieces):
    """export_by_name's pieces with every tensor copied to the CPU: a CUDA tensor gathered as a
    Python object is unpickled onto the sender's device (its cuda:N) on every rank: memory on
    another rank's GPU, or an error where that device is not visible."""

    def host(v):
        return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v

    return [
        dict(p, master=host(p["master"]), state={k: host(v) for k, v in p["state"].items()})
        for p in pieces
    ]


def full_state(engine):
    """({name: full fp32 tensor}, {name: optimizer state by name}) of a live engine, gathered over
    its dp axis: the same by-name state a checkpoint holds, on the CPU as one read from disk
    (tp-local tensors: tensor-parallel slices are not joined)."""
    every = engine.axis.all_gather_object(on_host(export_by_name(engine, copies=True, copy=False)))
    full = _assemble([dict(universal=dict(tp_rank=0, pieces=p)) for p in every], tp_size=1)
    trainable = {k for k, p in engine.module.named_parameters() if p.requires_grad}
    return (
        {k: master for k, (master, _) in full.items()},
        {k: state for k, (_, state) in full.items() if k in trainable},
    )


def _assemble(shards, need=None, tp_size=None, replicate_kv=False):
    """{name: (full master, {key: full state or scalar})} from the pieces in `shards`.

    need: {(name, saved tp rank): [(a, b), ...]} -- the element ranges of the saved tp-local tensors
    that must be covered (others may be missing: they are zeros). None: every parameter must be
    complete. tp_size: the saved tensor-parallel size (default: the highest tp rank seen + 1).
    replicate_kv: whether the saved layout held kv_proj whole (tp.kv_replicated)."""
    local = defaultdict(dict)  # name -> tp_rank -> [master, state, covered mask, shape]
    for shard in shards:
        u = shard["universal"]
        for p in u["pieces"]:
            n = math.prod(p["shape"])
            entry = local[p["name"]].setdefault(
                u["tp_rank"], [torch.zeros(n), {}, torch.zeros(n, dtype=torch.bool), p["shape"]]
            )
            entry[0][p["start"] : p["end"]] = p["master"]
            entry[2][p["start"] : p["end"]] = True
            for k, v in p["state"].items():
                if is_elementwise(v):
                    entry[1].setdefault(k, torch.zeros(n, dtype=v.dtype))[p["start"] : p["end"]] = v
                else:
                    entry[1][k] = v
    checks = (
        need.items()
        if need is not None
        else [((name, r), [(0, None)]) for name, by_rank in local.items() for r in by_rank]
    )
    for (name, r), ranges in checks:
        covered = local.get(name, {}).get(r, [None, None, torch.zeros(0, dtype=torch.bool)])[2]
        if not all(len(covered[a:b]) and covered[a:b].all() for a, b in ranges):
            raise ValueError(
                f"--resume: the checkpoint holds only part of {name}; it is incomplete"
            )
    full = {}
    for name, by_rank in local.items():
        # replicated: one copy
        t = 1 if tp.shard_rule(name, replicate_kv) is None else tp_size or max(by_rank) + 1
        if need is None and t > 1 and sorted(by_rank) != list(range(t)):
            raise ValueError(
                f"--resume: the checkpoint holds only part of {name}; it is incomplete"
            )
        some = next(iter(by_rank.values()))
        blank = [
            torch.zeros(math.prod(some[3])),
            {k: torch.zeros_like(v) if is_elementwise(v) else v for k, v in some[1].items()},
            None,
            some[3],
        ]
        # not read: zeros, never used
        ranks = [by_rank.get(r, blank) for r in range(t)] if t > 1 else [some]
        master = tp.unshard_param(name, [e[0].view(e[3]) for e in ranks], replicate_kv)
        state = {
            k: tp.unshard_param(name, [e[1][k].view(e[3]) for e in ranks], replicate_kv)
            if is_elementwise(v)
            else v
            for k, v in some[1].items()
        }
        full[name] = (master, state)
    return full


def _needed(engine, grid, saved_tp, saved_replicate_kv=False):
    """{(name, saved tp rank): [(a, b), ...]}: the saved element ranges this rank must read. Under
    the same tp size, the ranges of the pieces it owns (stage 0: whole parameters); under another tp
    size, the whole local tensors of the saved tp ranks whose slice overlaps this rank's (replicated
    parameters: tp rank 0)."""
    mine = defaultdict(list)  # name -> ranges of this rank's tp-local tensor
    for piece in held(engine):
        mine[piece.name].append((piece.start, piece.end))

    params = dict(engine.module.named_parameters())
    need = {}
    t, r = grid.tp.size, grid.tp_rank

    for name, ranges in mine.items():
        source = pp.saved_name(name, params.get(name))
        if t == saved_tp:
            need.setdefault((source, r), []).extend(ranges)
        elif tp.shard_rule(source, saved_replicate_kv) is None:
            need[(source, 0)] = [(0, None)]
        else:  # saved slice q of saved_tp overlaps this rank's slice r of t
            for q in range(saved_tp):
                if q * t < (r + 1) * saved_tp and r * saved_tp < (q + 1) * t:
                    need[(source, q)] = [(0, None)]
    return need


def shards_needed(manifest, need):
    """The shards (names) of the checkpoint `manifest` describes that hold a piece of
    `need` (_needed: what this rank will hold); every shard for a checkpoint without the
    manifest's piece index."""
    index = manifest.get("pieces")
    return [f for f in manifest["shards"] if index is None or _overlaps(index[f], need)]


def needed_by(manifest, cfg, engine, grid):
    """The shards this rank reads to load the checkpoint `manifest` describes (flash.agree asks it
    before any load: under the same layout its own, plus a peer's for what it holds but did not save
    -- a ZeRO-0 dp replica's pieces, the last pipeline stage's tied embedding)."""
    saved_tp = manifest["layout"].get("tp", 1)
    return shards_needed(manifest, _needed(engine, grid, saved_tp, tp.kv_replicated(cfg, saved_tp)))


def _overlaps(pieces, need):
    return any(
        b is None or (s < b and a < e)
        for name, q, s, e in pieces
        for a, b in need.get((name, q), ())
    )


def load(folder, cfg, engine, grid, layout, copy_of=None):
    """Load `folder` into this rank's engine under the current layout (resharding if it differs),
    reading only the shards whose pieces overlap what this rank holds (all of them for a checkpoint
    without the manifest's piece index). Returns this rank's saved state (its own shard when the
    layout is the same, else rank 0's), with `same_layout` telling whether per-rank RNG streams can
    be continued. copy_of(manifest, shard name): under the same layout, the path of a verified
    byte-identical copy of this rank's own shard to read instead of the disk (nanomega/flash.py:
    shared memory), or None; `copies` in the result names the shards so read, neither verified nor
    read on disk here."""
    manifest = checkpoint.read_manifest_json(folder)
    same = manifest["layout"] == layout and manifest["world"] == grid.world
    saved_tp = manifest["layout"].get("tp", 1)
    saved_kv, kv = tp.kv_replicated(cfg, saved_tp), tp.kv_replicated(cfg, grid.tp.size)

    # the shards holding what this rank needs, verified
    need = _needed(engine, grid, saved_tp, saved_kv)
    files = shards_needed(manifest, need)
    own = checkpoint.shard_name(grid.rank if same else 0)
    copies = {own: path} if same and copy_of and (path := copy_of(manifest, own)) else {}
    checkpoint.read_manifest(folder, cfg, verify=(set(files) | {own}) - set(copies))

    shards = {f: checkpoint.load_shard(folder, int(f[5:10]), copies.get(f)) for f in files}
    full = _assemble(shards.values(), need, saved_tp, saved_kv)

    # each parameter cut to this rank's tp slice, with its optimizer state
    params, optim = {}, {}
    for name, p in engine.module.named_parameters():
        # the last stage's copy of the tied embedding: the embedding
        source = pp.saved_name(name, p)
        # nothing of it is this rank's: an empty placeholder import_by_name never reads
        if source not in full:
            if any(k == source for k, _ in need):
                raise ValueError(f"--resume: the checkpoint in {folder} has no parameter {source}")
            params[name], optim[name] = torch.zeros(0), {}
            continue
        master, state = full[source]
        cut = (
            (lambda t: tp.shard_param(name, t, grid.tp_rank, grid.tp.size, kv))
            if grid.tp.size > 1
            else (lambda t: t)
        )
        params[name] = cut(master)
        if p.requires_grad:
            optim[name] = {k: cut(v) if is_elementwise(v) else v for k, v in state.items()}

    import_by_name(engine, params, optim)
    mine = (
        shards[own]
        if own in shards
        else checkpoint.load_shard(folder, int(own[5:10]), copies.get(own))
    )
    return dict(mine, same_layout=same, shards_read=sorted(files), copies=sorted(copies))


def weight_reader(folder):
    """(read, names): read(name) -> that parameter's full fp32 tensor, assembled on demand from the
    memory-mapped shards, so one parameter at a time is in memory (hf export streams with it)."""
    manifest = checkpoint.read_manifest_json(folder)
    shards = [checkpoint.load_shard(folder, r) for r in range(manifest["world"])]
    saved_tp = manifest["layout"].get("tp", 1)
    kv = tp.kv_replicated(GPTConfig(**manifest["config"]), saved_tp)
    pieces = defaultdict(lambda: defaultdict(list))  # name -> tp rank -> its pieces, no state
    for shard in shards:
        for p in shard["universal"]["pieces"]:
            pieces[p["name"]][shard["universal"]["tp_rank"]].append(dict(p, state={}))

    def read(name):
        one = [dict(universal=dict(tp_rank=r, pieces=ps)) for r, ps in pieces[name].items()]
        return _assemble(one, None, saved_tp, kv)[name][0]

    return read, list(pieces)


def full_checkpoint(folder):
    """{name: (full fp32 tensor, {key: its full optimizer state, or the scalar})} of a checkpoint
    saved under any layout (tests: the layout fuzzer compares Adam's moments)."""
    manifest = checkpoint.read_manifest_json(folder)
    # every shard
    shards = [checkpoint.load_shard(folder, r) for r in range(manifest["world"])]
    saved_tp = manifest["layout"].get("tp", 1)
    kv = tp.kv_replicated(GPTConfig(**manifest["config"]), saved_tp)
    return _assemble(shards, None, saved_tp, kv)


def full_weights(folder):
    """{name: full fp32 tensor} of a checkpoint saved under any layout (for sampling and tests)."""
    return {name: master for name, (master, _) in full_checkpoint(folder).items()}
