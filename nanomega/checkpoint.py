"""Checkpoints: each rank writes its own shard, atomically; a manifest with checksums comes last.

A checkpoint is a folder `OUT/ckpt/step_000123/`: one `rank_00007.pt` per rank (written to a
temporary name, then renamed) with its `rank_00007.json` (sha256, size, pieces), and a
`manifest.json` that gathers them, written after a barrier; every file and directory is fsynced.
`find_resume` verifies folders newest first and falls back, naming what it skipped; `retain` keeps
the last K. The manifest is read here only (read_manifest_json, read_manifest, saved_model);
resharding on load is reshard.py.

Formula: a job of N ranks, each failing with probability p per hour, survives an hour with (1-p)^N.
Lesson: lessons/19-checkpoints-and-failures.md
"""

import dataclasses
import errno
import json
import os
import re
import shutil

import torch

from nanomega.data import sha256_file as _sha256
from nanomega.gpt_config import SHAPE_KEYS, GPTConfig


class CorruptCheckpoint(ValueError):
    """A checkpoint folder that is incomplete or damaged (discovery falls back past it)."""


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a directory too: its entries (a rename) reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path, write):
    """write(tmp), fsync it, rename it over `path`, fsync the directory: `path` is the
    old file or the new."""
    tmp = f"{path}.tmp"
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(os.path.dirname(os.path.abspath(path)))


def write_text(text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    return write


def _index(state):
    """[name, tp_rank, start, end] of every piece a shard holds: the manifest's map from
    pieces to shards."""
    u = state.get("universal", {})
    return [[p["name"], u["tp_rank"], p["start"], p["end"]] for p in u.get("pieces", [])]


def save(out_dir, step, cfg, state, grid, layout=None, wrap=None, keep=None):
    """Every rank calls this with its own `state`; returns the checkpoint folder once the manifest
    exists. wrap(file): what torch.save writes the shard through (job/guard.py: the hang watchdog
    counts its writes). keep(folder): called once this rank's shard is written, before the manifest
    (flash.py: a copy in memory)."""
    folder = write_shard(out_dir, step, state, grid.rank, wrap)
    if keep:
        keep(folder)
    write_manifest(out_dir, folder, step, cfg, grid, layout)
    return folder


def write_shard(out_dir, step, state, rank, wrap=None):
    folder = os.path.join(out_dir, "ckpt", f"step_{step:06d}")
    os.makedirs(folder, exist_ok=True)
    shard = os.path.join(folder, shard_name(rank))
    made = {}

    # each rank hashes its own shard (the writer thread, under --async-save), not rank 0 all
    def write(tmp):
        try:
            with open(tmp, "wb") as f:
                torch.save(state, wrap(f) if wrap else f)
        except (OSError, RuntimeError) as e:
            # torch's writer may report a full disk as "unexpected pos"
            if (
                getattr(e, "errno", None) == errno.ENOSPC
                or shutil.disk_usage(folder).free < 1 << 20
            ):
                raise OSError(errno.ENOSPC, "No space left on device", tmp) from e
            raise
        made.update(sha256=_sha256(tmp), size=os.path.getsize(tmp))

    replace_atomically(shard, write)
    made["pieces"] = _index(state)
    replace_atomically(shard[:-3] + ".json", write_text(json.dumps(made)))  # for the manifest
    return folder


def write_manifest(out_dir, folder, step, cfg, grid, layout=None):
    """Collective: once every rank's shard is on disk, rank 0 writes the manifest,
    then the pointer."""
    grid.barrier()  # every shard is on disk before the manifest claims the checkpoint is complete
    if grid.rank == 0:
        manifest_and_pointer(out_dir, folder, step, cfg, grid.world, layout)
    grid.barrier()


def manifest_and_pointer(out_dir, folder, step, cfg, world, layout):
    """Rank 0, once every shard is on disk: the manifest from the shards' .json files, then the
    pointer."""
    shards = sorted(f for f in os.listdir(folder) if f.startswith("rank_") and f.endswith(".pt"))
    # write_shard's
    made = {f: json.load(open(os.path.join(folder, f[:-3] + ".json"))) for f in shards}

    manifest = dict(
        step=step,
        config=dataclasses.asdict(cfg),
        layout=layout or {},
        world=world,
        shards={f: m["sha256"] for f, m in made.items()},
        sizes={f: m["size"] for f, m in made.items()},
        pieces={f: m["pieces"] for f, m in made.items()},
    )

    # the manifest first, then the pointer to its folder
    replace_atomically(
        os.path.join(folder, "manifest.json"), write_text(json.dumps(manifest, indent=1))
    )
    replace_atomically(
        os.path.join(out_dir, "ckpt", "latest"), write_text(os.path.basename(folder))
    )


def step_folders(out_dir):
    """[(step, folder)] of OUT/ckpt/step_* newest first -- complete or not."""
    root = os.path.join(out_dir, "ckpt")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [
        (int(m.group(1)), os.path.join(root, n))
        for n in names
        if (m := re.fullmatch(r"step_(\d+)", n))
    ]
    return sorted(steps, reverse=True)


def latest(out_dir):
    """The newest folder holding a manifest (not verified), or None. The `latest` pointer is not
    trusted: a lost or stale pointer must never make a resume start from step 0."""
    return next(
        (f for _, f in step_folders(out_dir) if os.path.isfile(os.path.join(f, "manifest.json"))),
        None,
    )


def read_manifest_json(folder):
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"{folder} has no manifest.json (a save that did not finish)")
    try:
        manifest = json.loads(open(path).read())
        manifest["step"], manifest["world"], manifest["shards"], manifest["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(
            f"{path} is empty, truncated or not a manifest ({type(e).__name__}: {e})"
        ) from e
    return manifest


def saved_model(out_dir):
    """(folder, GPTConfig, tokenizer name, [skipped folder: reason]) of the newest checkpoint in
    out_dir that verifies -- its manifest, and every shard against its checksum, as --resume does:
    what a command rebuilds the model from (tools/sample.py, tools/hf.py). A damaged newer one is
    skipped and named, never read."""
    skipped = []
    for _, folder in step_folders(out_dir):
        try:
            manifest = read_manifest_json(folder)
            cfg = GPTConfig(**manifest["config"])
            read_manifest(folder, cfg)  # every shard's checksum
        except CorruptCheckpoint as e:
            skipped.append(f"{os.path.basename(folder)}: {e}")
            continue
        return folder, cfg, manifest.get("layout", {}).get("tokenizer", "shakespeare-4k"), skipped
    raise FileNotFoundError(
        f"--out-dir {out_dir} holds no checkpoint that verifies"
        f"{' (' + '; '.join(skipped) + ')' if skipped else ''}; train first (nanomega/train.py)"
    )


def read_manifest(folder, cfg, verify=None):
    """Check shape and checksums (of the shards in `verify`, default all; the others' presence and
    size); a mismatch is a clear error, never a silently wrong resume."""
    manifest = read_manifest_json(folder)
    saved, want = manifest["config"], dataclasses.asdict(cfg)
    # a checkpoint older than a key: that key's default
    saved = {**dataclasses.asdict(GPTConfig()), **saved}
    diff = [f"{k}={saved.get(k)} (now {want[k]})" for k in SHAPE_KEYS if saved.get(k) != want[k]]
    if diff:
        raise ValueError(
            f"--resume: the checkpoint in {folder} is for another model shape: {', '.join(diff)}; "
            f"use the same model flags or another --out-dir"
        )

    if len(manifest["shards"]) != manifest["world"]:
        raise CorruptCheckpoint(
            f"{folder}: the manifest lists {len(manifest['shards'])} shards for a world of "
            f"{manifest['world']}"
        )

    # each shard: present, its size, and (those in verify) its checksum and finite values
    sizes = manifest.get("sizes", {})
    for name, digest in manifest["shards"].items():
        path = os.path.join(folder, name)
        if (
            not os.path.isfile(path)
            or (name in sizes and os.path.getsize(path) != sizes[name])
            or ((verify is None or name in verify) and _sha256(path) != digest)
        ):
            raise CorruptCheckpoint(f"shard {path} is missing or does not match its checksum")
        bad = (verify is None or name in verify) and nonfinite(
            torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        )
        if bad:  # a diverged step's weights pass their checksums: refused like a damaged shard
            raise CorruptCheckpoint(
                f"shard {path} holds non-finite values ({bad}): a diverged step was saved"
            )
    return manifest


def nonfinite(state, where="state"):
    """The path of the first floating-point tensor in a shard's state holding a NaN or an infinity
    (a piece named by its parameter), else None."""
    if torch.is_tensor(state):
        return (
            where if state.is_floating_point() and not bool(torch.isfinite(state).all()) else None
        )
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = [(v.get("name", i) if isinstance(v, dict) else i, v) for i, v in enumerate(state)]
    else:
        return None
    return next(
        (found for key, value in items if (found := nonfinite(value, f"{where}/{key}"))), None
    )


def shard_name(rank):
    return f"rank_{rank:05d}.pt"


def find_resume(out_dir, cfg, resume_from=None):
    """(folder or None, [skipped folder: reason]): the checkpoint to resume from.

    `resume_from` (a step number or a folder) is verified alone: an error if it fails. Otherwise
    every step folder, newest first, until one verifies. No verified checkpoint: start fresh if no
    folder was ever complete (a first save that crashed), else refuse -- starting at step 0 would
    overwrite the run.
    """
    if resume_from is not None:
        folder = (
            os.path.join(out_dir, "ckpt", f"step_{int(resume_from):06d}")
            if str(resume_from).isdigit()
            else str(resume_from)
        )
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"--resume-from {resume_from}: {folder} is not a checkpoint folder"
            )
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
        raise ValueError(
            f"--resume: no checkpoint in {out_dir}/ckpt verifies ({'; '.join(skipped)}); restore a "
            f"shard, or move the folders away to start fresh"
        )
    return None, skipped


def set_aside_newer(out_dir, step):
    """Resuming from an older step on purpose: newer step folders move to OUT/ckpt/abandoned/ (kept,
    never deleted), so that a later --resume does not jump back onto the abandoned timeline."""
    moved = []
    for s, folder in step_folders(out_dir):
        if s > step:
            dest = os.path.join(out_dir, "ckpt", "abandoned", os.path.basename(folder))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(folder, dest if not os.path.exists(dest) else f"{dest}.{os.getpid()}")
            moved.append(folder)
    return moved


def retain(out_dir, keep_last, protect=(), upto=None):
    """Delete complete checkpoints older than the newest `keep_last` ones, never one in `protect`
    (the one this run resumed from); incomplete folders older than the newest complete one go too.
    Returns them. upto: the step just saved. A folder past it belongs to another timeline (a damaged
    newer checkpoint the run fell back from): it is neither counted as newest nor deleted, so the
    checkpoint just written stays."""
    folders = [(s, f) for s, f in step_folders(out_dir) if upto is None or s <= upto]
    complete = [f for _, f in folders if os.path.isfile(os.path.join(f, "manifest.json"))]
    if not complete:
        return []

    newest = int(os.path.basename(complete[0])[5:])
    keep = set(complete[:keep_last]) | {os.path.abspath(p) for p in protect if p} | set(protect)
    gone = [
        f for s, f in folders if s < newest and f not in keep and os.path.abspath(f) not in keep
    ]

    for folder in gone:
        shutil.rmtree(folder)
    if gone:
        _fsync(os.path.join(out_dir, "ckpt"))
    return gone


def load_shard(folder, rank, path=None):
    """One rank's shard on the CPU, whatever device saved it; memory-mapped: only what is
    read is paged in. path: a verified byte-identical copy to read instead (flash.py's,
    in shared memory)."""
    return torch.load(
        path or os.path.join(folder, shard_name(rank)),
        map_location="cpu",
        mmap=True,
        weights_only=False,
    )
