"""Checkpoints: every rank writes its own shard, atomically; a manifest with checksums is written last.

Idea: a checkpoint is a folder `OUT/ckpt/step_000123/` holding one `rank_00007.pt` per rank and a
`manifest.json` (step, model config, layout, sha256 of every shard). A shard is written to a temporary name
and renamed, so a crash mid-write leaves a `.tmp` file, never a wrong shard; the manifest is written only
after every rank has finished (a barrier), and `OUT/ckpt/latest` points at the newest folder whose manifest
exists. Every file and its directory are fsynced, so a power loss never leaves an empty pointer or manifest.
Discovery (`find_resume`) scans the step folders -- the pointer is only a hint -- verifies them newest first
and falls back to the newest complete, verified one, naming what it skipped and why (OPT-175B's logbook:
a bad shard must cost one checkpoint interval, not the run). `retain` keeps the last K.

Resharding (DeepSpeed's universal checkpoint, done on load): besides its own state, each rank saves its
*pieces by name* -- for every parameter slice it owns, the element range of its (tensor-parallel) local
tensor, the fp32 master values and the optimizer state. Nothing is gathered to save. Loading under any
layout (tp, pp, dp, ZeRO stage changed) rebuilds each full tensor from the pieces (un-sharding tp with
tp.unshard_param), then each rank keeps its new slices (tp.shard_param, ZeroEngine.load_full). A rank reads
only the shards it needs: the manifest indexes every shard's pieces (name, tp rank, element range), and a rank
opens a shard only if one of its pieces overlaps what the rank will hold -- under the same layout that is its
own shard (its dp-rank-0 peer's at ZeRO stage 0, where replicas save nothing). Shards are always read to the
CPU (map_location="cpu", memory-mapped), then copied to the rank's device: a CUDA checkpoint loads on a
machine with fewer GPUs, or none.
Failure law: a job of N ranks, each failing with probability p per hour, survives an hour with (1-p)^N.
Lesson: lessons/10-checkpoints-and-failures.md
"""
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import threading
from collections import defaultdict

import torch

from nanomega import tp

SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "alibi", "embed_layernorm")


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CorruptCheckpoint(ValueError):
    """A checkpoint folder that is incomplete or damaged (discovery falls back past it)."""


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a directory too: its entries (a rename) reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_atomically(path, write):
    """write(tmp), fsync it, rename it over `path`, fsync the directory: `path` is the old file or the new."""
    tmp = f"{path}.tmp"
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(os.path.dirname(os.path.abspath(path)))


def _write_text(text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    return write


def _index(state):
    """[name, tp_rank, start, end] of every piece a shard holds: the manifest's map from pieces to shards."""
    u = state.get("universal", {})
    return [[p["name"], u["tp_rank"], p["start"], p["end"]] for p in u.get("pieces", [])]


def save(out_dir, step, cfg, state, grid, layout=None):
    """Every rank calls this with its own `state`; returns the checkpoint folder once the manifest exists."""
    folder = write_shard(out_dir, step, state, grid.rank)
    write_manifest(out_dir, folder, step, cfg, grid, layout)
    return folder


def write_shard(out_dir, step, state, rank):
    folder = os.path.join(out_dir, "ckpt", f"step_{step:06d}")
    os.makedirs(folder, exist_ok=True)
    shard = os.path.join(folder, shard_name(rank))
    _replace_atomically(shard, lambda tmp: torch.save(state, tmp))
    _replace_atomically(shard[:-3] + ".json", _write_text(json.dumps(_index(state))))  # its pieces, for the manifest
    return folder


def write_manifest(out_dir, folder, step, cfg, grid, layout=None):
    """Collective: once every rank's shard is on disk, rank 0 writes the manifest, then the pointer."""
    grid.barrier()  # every shard is on disk before the manifest claims the checkpoint is complete
    if grid.rank == 0:
        shards = sorted(f for f in os.listdir(folder) if f.startswith("rank_") and f.endswith(".pt"))
        manifest = dict(step=step, config=dataclasses.asdict(cfg), layout=layout or {}, world=grid.world,
                        shards={f: _sha256(os.path.join(folder, f)) for f in shards},
                        sizes={f: os.path.getsize(os.path.join(folder, f)) for f in shards},
                        pieces={f: json.load(open(os.path.join(folder, f[:-3] + ".json"))) for f in shards})
        _replace_atomically(os.path.join(folder, "manifest.json"), _write_text(json.dumps(manifest, indent=1)))
        _replace_atomically(os.path.join(out_dir, "ckpt", "latest"), _write_text(os.path.basename(folder)))
    grid.barrier()


class AsyncSaver:
    """--async-save ("flash" checkpoints, as DLRover's and torch.distributed.checkpoint.async_save): at the
    step boundary the state is only copied to CPU memory; a thread writes the shard while training goes on;
    the manifest comes once every rank's write has finished (`poll` asks all ranks at each step boundary), so
    a crash mid-write leaves the previous checkpoint the newest complete one. One write in flight at a time."""

    def __init__(self, out_dir, cfg, grid, layout):
        self.out_dir, self.cfg, self.grid, self.layout = out_dir, cfg, grid, layout
        self.thread, self.error, self.step = None, None, None

    def start(self, step, state):
        self.wait()
        state = _to_cpu(state)  # the training step may overwrite device memory next
        self.step, self.error = step, None
        self.thread = threading.Thread(target=self._write, args=(step, state), name="nanomega-ckpt", daemon=True)
        self.thread.start()

    def _write(self, step, state):
        try:
            write_shard(self.out_dir, step, state, self.grid.rank)
        except BaseException as e:  # re-raised on the training thread by wait()
            self.error = e

    def poll(self, anyone_busy):
        """At a step boundary (every rank): finish the checkpoint once no rank is still writing."""
        if self.thread is not None and not anyone_busy(self.thread.is_alive()):
            self.wait()

    def wait(self):
        """Collective: join this rank's writer and write the manifest. Returns the folder, or None."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread = None
        if self.error:
            raise self.error
        folder = os.path.join(self.out_dir, "ckpt", f"step_{self.step:06d}")
        write_manifest(self.out_dir, folder, self.step, self.cfg, self.grid, self.layout)
        return folder


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=obj.device.type != "cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def step_folders(out_dir):
    """[(step, folder)] of OUT/ckpt/step_* newest first -- complete or not."""
    root = os.path.join(out_dir, "ckpt")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := re.fullmatch(r"step_(\d+)", n))]
    return sorted(steps, reverse=True)


def latest(out_dir):
    """The newest folder holding a manifest (not verified), or None. The `latest` pointer is not trusted:
    a lost or stale pointer must never make a resume start from step 0."""
    return next((f for _, f in step_folders(out_dir) if os.path.isfile(os.path.join(f, "manifest.json"))), None)


def _manifest_json(folder):
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"{folder} has no manifest.json (a save that did not finish)")
    try:
        manifest = json.loads(open(path).read())
        manifest["step"], manifest["world"], manifest["shards"], manifest["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{path} is empty, truncated or not a manifest ({type(e).__name__}: {e})")
    return manifest


def read_manifest(folder, cfg, verify=None):
    """Check shape and checksums (of the shards in `verify`, default all; the others' presence and size);
    a mismatch is a clear error, never a silently wrong resume."""
    manifest = _manifest_json(folder)
    saved, want = manifest["config"], dataclasses.asdict(cfg)
    diff = [f"{k}={saved.get(k)} (now {want[k]})" for k in SHAPE_KEYS if saved.get(k) != want[k]]
    if diff:
        raise ValueError(f"--resume: the checkpoint in {folder} is for another model shape: {', '.join(diff)}; "
                         f"use the same model flags or another --out-dir")
    if len(manifest["shards"]) != manifest["world"]:
        raise CorruptCheckpoint(f"{folder}: the manifest lists {len(manifest['shards'])} shards for a world of "
                                f"{manifest['world']}")
    sizes = manifest.get("sizes", {})
    for name, digest in manifest["shards"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or (name in sizes and os.path.getsize(path) != sizes[name]) or \
                ((verify is None or name in verify) and _sha256(path) != digest):
            raise CorruptCheckpoint(f"shard {path} is missing or does not match its checksum")
    return manifest


def shard_name(rank):
    return f"rank_{rank:05d}.pt"


def find_resume(out_dir, cfg, resume_from=None):
    """(folder or None, [skipped folder: reason]): the checkpoint to resume from.

    `resume_from` (a step number or a folder) is verified alone: an error if it fails. Otherwise every step
    folder, newest first, until one verifies. No verified checkpoint: start fresh if no folder was ever
    complete (a first save that crashed), else refuse -- starting at step 0 would overwrite the run.
    """
    if resume_from is not None:
        folder = os.path.join(out_dir, "ckpt", f"step_{int(resume_from):06d}") if str(resume_from).isdigit() \
            else str(resume_from)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"--resume-from {resume_from}: {folder} is not a checkpoint folder")
        try:
            read_manifest(folder, cfg)
        except CorruptCheckpoint as e:
            raise ValueError(f"--resume-from {resume_from}: {e}; choose another step") from None
        return folder, []
    skipped = []
    for _, folder in step_folders(out_dir):
        try:
            read_manifest(folder, cfg)
            return folder, skipped
        except CorruptCheckpoint as e:
            skipped.append(f"{os.path.basename(folder)}: {e}")
    if any(os.path.isfile(os.path.join(f, "manifest.json")) for _, f in step_folders(out_dir)):
        raise ValueError(f"--resume: no checkpoint in {out_dir}/ckpt verifies ({'; '.join(skipped)}); restore a "
                         f"shard, or move the folders away to start fresh")
    return None, skipped


def clean_tmp(out_dir):
    """Remove `.tmp` files a crash left behind (only while this job holds the out-dir lock). Returns them."""
    found = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(out_dir, "ckpt")) for f in files
             if f.endswith(".tmp")]
    for path in found:
        os.remove(path)
    return found


def set_aside_newer(out_dir, step):
    """Resuming from an older step on purpose: newer step folders move to OUT/ckpt/abandoned/ (kept, never
    deleted), so that a later --resume does not jump back onto the abandoned timeline."""
    moved = []
    for s, folder in step_folders(out_dir):
        if s > step:
            dest = os.path.join(out_dir, "ckpt", "abandoned", os.path.basename(folder))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(folder, dest if not os.path.exists(dest) else f"{dest}.{os.getpid()}")
            moved.append(folder)
    return moved


def retain(out_dir, keep_last, protect=()):
    """Delete complete checkpoints older than the newest `keep_last` ones, never one in `protect` (the one
    this run resumed from); incomplete folders older than the newest complete one go too. Returns them."""
    complete = [f for _, f in step_folders(out_dir) if os.path.isfile(os.path.join(f, "manifest.json"))]
    if not complete:
        return []
    newest = int(os.path.basename(complete[0])[5:])
    keep = set(complete[:keep_last]) | {os.path.abspath(p) for p in protect if p} | set(protect)
    gone = [f for s, f in step_folders(out_dir) if s < newest and f not in keep and os.path.abspath(f) not in keep]
    for folder in gone:
        shutil.rmtree(folder)
    if gone:
        _fsync(os.path.join(out_dir, "ckpt"))
    return gone


def load_shard(folder, rank):
    """One rank's shard on the CPU, whatever device saved it; memory-mapped: only what is read is paged in."""
    return torch.load(os.path.join(folder, shard_name(rank)), map_location="cpu", mmap=True, weights_only=False)


def _elementwise(v):
    return torch.is_tensor(v) and v.dim() > 0


def universal_pieces(engine, grid):
    """This rank's share of every parameter by name: (range, fp32 master, optimizer state) per owned slice.
    Replicas write nothing (dp ranks > 0 at stage 0), nor does the last pipeline stage's copy of the tied
    embedding (the first stage saves it)."""
    pieces = []
    if engine.stage == 0 and grid.dp_rank != 0:
        return dict(tp_rank=grid.tp_rank, pieces=pieces)
    for m, _, g, i, a, b in engine.pieces:
        if g is None or g.params[i] is engine.shared and not grid.first_stage:
            continue
        o, state = g.offsets[i], engine.optimizer.state.get(m, {})
        pieces.append(dict(name=g.names[i], shape=tuple(g.shapes[i]), start=a - o, end=b - o,
                           master=g.master[a - g.lo:b - g.lo].detach().clone(),
                           state={k: v.detach().reshape(-1).clone() if _elementwise(v) else v.clone()
                                  for k, v in state.items()}))
    for g in engine.sharded.frozen if engine.sharded else []:  # ZeRO-3 frozen parameters: their shards
        for i, a, b in g.pieces():
            o = g.offsets[i]
            pieces.append(dict(name=g.names[i], shape=tuple(g.shapes[i]), start=a - o, end=b - o,
                               master=g.shard[a - g.lo:b - g.lo].detach().float().clone(), state={}))
    for name, p in engine.module.named_parameters():  # other frozen parameters: whole, from dp rank 0
        if not p.requires_grad and grid.dp_rank == 0 and engine.stage < 3:
            pieces.append(dict(name=name, shape=tuple(p.shape), start=0, end=p.numel(),
                               master=p.detach().float().reshape(-1).clone(), state={}))
    return dict(tp_rank=grid.tp_rank, pieces=pieces)


def _assemble(shards, need=None, tp_size=None):
    """{name: (full master, {key: full state or scalar})} from the pieces in `shards`.

    need: {(name, saved tp rank): [(a, b), ...]} -- the element ranges of the saved tp-local tensors that must
    be covered (others may be missing: they are zeros). None: every parameter must be complete.
    tp_size: the saved tensor-parallel size (default: the highest tp rank seen + 1)."""
    local = defaultdict(dict)  # name -> tp_rank -> [master, state, covered mask, shape]
    for shard in shards:
        u = shard["universal"]
        for p in u["pieces"]:
            n = math.prod(p["shape"])
            entry = local[p["name"]].setdefault(u["tp_rank"], [torch.zeros(n), {}, torch.zeros(n, dtype=torch.bool),
                                                               p["shape"]])
            entry[0][p["start"]:p["end"]] = p["master"]
            entry[2][p["start"]:p["end"]] = True
            for k, v in p["state"].items():
                if _elementwise(v):
                    entry[1].setdefault(k, torch.zeros(n, dtype=v.dtype))[p["start"]:p["end"]] = v
                else:
                    entry[1][k] = v
    checks = need.items() if need is not None else \
        [((name, r), [(0, None)]) for name, by_rank in local.items() for r in by_rank]
    for (name, r), ranges in checks:
        covered = local.get(name, {}).get(r, [None, None, torch.zeros(0, dtype=torch.bool)])[2]
        if not all(len(covered[a:b]) and covered[a:b].all() for a, b in ranges):
            raise ValueError(f"--resume: the checkpoint holds only part of {name}; it is incomplete")
    full = {}
    for name, by_rank in local.items():
        t = 1 if tp._rule(name) is None else tp_size or max(by_rank) + 1  # replicated: any one copy
        if need is None and t > 1 and sorted(by_rank) != list(range(t)):
            raise ValueError(f"--resume: the checkpoint holds only part of {name}; it is incomplete")
        some = next(iter(by_rank.values()))
        blank = [torch.zeros(math.prod(some[3])), {k: torch.zeros_like(v) if _elementwise(v) else v
                                                   for k, v in some[1].items()}, None, some[3]]
        ranks = [by_rank.get(r, blank) for r in range(t)] if t > 1 else [some]  # not read: zeros, never used
        master = tp.unshard_param(name, [e[0].view(e[3]) for e in ranks])
        state = {k: tp.unshard_param(name, [e[1][k].view(e[3]) for e in ranks]) if _elementwise(v) else v
                 for k, v in some[1].items()}
        full[name] = (master, state)
    return full


def _needed(engine, grid, saved_tp):
    """{(name, saved tp rank): [(a, b), ...]}: the saved element ranges this rank must read. Under the same tp
    size, the ranges of the pieces it owns (stage 0: whole parameters); under another tp size, the whole
    local tensors of the saved tp ranks whose slice overlaps this rank's (replicated parameters: tp rank 0)."""
    held = defaultdict(list)  # name -> ranges of this rank's tp-local tensor
    for _, _, g, i, a, b in engine.pieces:
        if g is not None:
            held[g.names[i]].append((a - g.offsets[i], b - g.offsets[i]))
    for g in engine.sharded.frozen if engine.sharded else []:
        for i, a, b in g.pieces():
            held[g.names[i]].append((a - g.offsets[i], b - g.offsets[i]))
    params = dict(engine.module.named_parameters())
    for name, p in params.items():
        if not p.requires_grad and engine.stage < 3:
            held[name].append((0, p.numel()))
    need = {}
    t, r = grid.tp.size, grid.tp_rank
    for name, ranges in held.items():
        source = "embed.wte.weight" if getattr(params.get(name), "shared_embedding", False) else name
        if t == saved_tp:
            need.setdefault((source, r), []).extend(ranges)
        elif tp._rule(source) is None:
            need[(source, 0)] = [(0, None)]
        else:  # saved slice q of saved_tp overlaps this rank's slice r of t
            for q in range(saved_tp):
                if q * t < (r + 1) * saved_tp and r * saved_tp < (q + 1) * t:
                    need[(source, q)] = [(0, None)]
    return need


def _overlaps(pieces, need):
    return any(b is None or (s < b and a < e) for name, q, s, e in pieces for a, b in need.get((name, q), ()))


def _local_shapes(engine):
    shapes = {name: p.shape for name, p in engine.module.named_parameters()}
    for g in engine.groups + (engine.sharded.frozen if engine.sharded else []):
        shapes.update(zip(g.names, g.shapes))  # ZeRO-3 parameters are empty tensors between uses
    return shapes


def load(folder, cfg, engine, grid, layout):
    """Load `folder` into this rank's engine under the current layout (resharding if it differs), reading
    only the shards whose pieces overlap what this rank holds (all of them for a checkpoint without the
    manifest's piece index). Returns this rank's saved state (its own shard when the layout is the same, else
    rank 0's), with `same_layout` telling whether per-rank RNG streams can be continued."""
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    same = manifest["layout"] == layout and manifest["world"] == grid.world
    need = _needed(engine, grid, manifest["layout"].get("tp", 1))
    index = manifest.get("pieces")
    files = [f for f in manifest["shards"] if index is None or _overlaps(index[f], need)]
    own = shard_name(grid.rank if same else 0)
    read_manifest(folder, cfg, verify=set(files) | {own})
    shards = {f: torch.load(os.path.join(folder, f), map_location="cpu", mmap=True, weights_only=False)
              for f in files}
    full = _assemble(shards.values(), need, manifest["layout"].get("tp", 1))
    params, optim, shapes = {}, {}, _local_shapes(engine)
    for name, p in engine.module.named_parameters():
        source = "embed.wte.weight" if getattr(p, "shared_embedding", False) else name  # the tied copy
        if source not in full:  # nothing of it is this rank's: a placeholder load_full never reads
            if any(k == source for k, _ in need):
                raise ValueError(f"--resume: the checkpoint in {folder} has no parameter {source}")
            params[name], optim[name] = torch.zeros(shapes[name]), {}
            continue
        master, state = full[source]
        cut = (lambda t: tp.shard_param(name, t, grid.tp_rank, grid.tp.size)) if grid.tp.size > 1 else (lambda t: t)
        params[name] = cut(master)
        if p.requires_grad:
            optim[name] = {k: cut(v) if _elementwise(v) else v for k, v in state.items()}
    engine.load_full(params, optim)
    mine = shards[own] if own in shards else load_shard(folder, int(own[5:10]))
    return dict(mine, same_layout=same, shards_read=sorted(files))


def full_weights(folder):
    """{name: full fp32 tensor} of a checkpoint saved under any layout (for sampling and tests)."""
    world = _manifest_json(folder)["world"]  # sampling needs every shard
    return {name: master for name, (master, _) in _assemble([load_shard(folder, r) for r in range(world)]).items()}
