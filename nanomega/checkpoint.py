"""Checkpoints: every rank writes its own shard, atomically; a manifest with checksums is written last.

Idea: a checkpoint is a folder `OUT/ckpt/step_000123/` holding one `rank_00007.pt` per rank and a
`manifest.json` (step, model config, layout, sha256 of every shard). A shard is written to a temporary name
and renamed, so a crash mid-write leaves a `.tmp` file, never a wrong shard; the manifest is written only
after every rank has finished (a barrier), and `OUT/ckpt/latest` points at the newest folder whose manifest
exists. Loading reads `latest`, verifies the checksums and the model shape, and hands each rank its state.
Failure law: a job of N ranks, each failing with probability p per hour, survives an hour with (1-p)^N.
Lesson: lessons/10-checkpoints-and-failures.md
"""
import dataclasses
import hashlib
import json
import os

import torch

SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "alibi", "embed_layernorm")


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _replace_atomically(path, write):
    tmp = f"{path}.tmp"
    write(tmp)
    os.replace(tmp, path)


def save(out_dir, step, cfg, state, grid, layout=None):
    """Every rank calls this with its own `state`; returns the checkpoint folder once the manifest exists."""
    folder = os.path.join(out_dir, "ckpt", f"step_{step:06d}")
    os.makedirs(folder, exist_ok=True)
    shard = os.path.join(folder, f"rank_{grid.rank:05d}.pt")
    _replace_atomically(shard, lambda tmp: torch.save(state, tmp))
    grid.barrier()  # every shard is on disk before the manifest claims the checkpoint is complete
    if grid.rank == 0:
        shards = sorted(f for f in os.listdir(folder) if f.startswith("rank_") and f.endswith(".pt"))
        manifest = dict(step=step, config=dataclasses.asdict(cfg), layout=layout or {}, world=grid.world,
                        shards={f: _sha256(os.path.join(folder, f)) for f in shards})
        _replace_atomically(os.path.join(folder, "manifest.json"),
                            lambda tmp: open(tmp, "w").write(json.dumps(manifest, indent=1)))
        _replace_atomically(os.path.join(out_dir, "ckpt", "latest"),
                            lambda tmp: open(tmp, "w").write(os.path.basename(folder)))
    grid.barrier()
    return folder


def latest(out_dir):
    """The newest complete checkpoint folder, or None. A folder without a manifest is ignored."""
    pointer = os.path.join(out_dir, "ckpt", "latest")
    if not os.path.isfile(pointer):
        return None
    folder = os.path.join(out_dir, "ckpt", open(pointer).read().strip())
    if not os.path.isfile(os.path.join(folder, "manifest.json")):
        raise ValueError(f"--resume: {pointer} names {folder}, which has no manifest.json; "
                         f"remove the pointer to start fresh or restore the folder")
    return folder


def read_manifest(folder, cfg):
    """Check shape and checksums; a mismatch is a clear error, never a silently wrong resume."""
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    saved, want = manifest["config"], dataclasses.asdict(cfg)
    diff = [f"{k}={saved.get(k)} (now {want[k]})" for k in SHAPE_KEYS if saved.get(k) != want[k]]
    if diff:
        raise ValueError(f"--resume: the checkpoint in {folder} is for another model shape: {', '.join(diff)}; "
                         f"use the same model flags or another --out-dir")
    for name, digest in manifest["shards"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or _sha256(path) != digest:
            raise ValueError(f"--resume: shard {path} is missing or does not match its checksum; "
                             f"restore it or resume from an older step folder")
    return manifest


def load_shard(folder, rank):
    return torch.load(os.path.join(folder, f"rank_{rank:05d}.pt"), weights_only=False)
