"""Flash restore: each rank keeps a byte-for-byte copy of its newest checkpoint shard in host memory
(/dev/shm), and a rank restarted on the same host reads its shard from there instead of from storage
(DLRover's Flash Checkpoint; our own code).

A copy is read only when it is for the chosen step and its bytes hash to the manifest's sha256 of
the rank's own shard; anything else reads the disk, so the restore is the same by construction.
Discovery reads no shard either (look, then agree): each rank verifies its own copy, and one vote
decides.

Formula: restore time ~ hash + read of one shard at memory bandwidth, instead of (discovery: every
shard, then the own one again) at storage bandwidth.
Lesson: lessons/19-checkpoints-and-failures.md
"""

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import sys

import torch

from nanomega import checkpoint, reshard
from nanomega.data import sha256_file

SHM = "/dev/shm"


def folder(out_dir):
    """The shared-memory folder of an out-dir (keyed by its realpath: one per out-dir and host)."""
    return os.path.join(
        SHM, "nanomega-" + hashlib.sha256(os.path.realpath(out_dir).encode()).hexdigest()[:12]
    )


def prefix(out_dir, rank):
    """Every file of this rank's copies starts so: rank_0000K.step_ (then 000123.pt, .json, a
    .tmp)."""
    return os.path.join(folder(out_dir), f"{checkpoint.shard_name(rank)[:-3]}.step_")


def drop(out_dir, rank):
    """Remove this rank's copies of out_dir (any step, half-written ones too), and the
    folder once empty."""
    for path in glob.glob(prefix(out_dir, rank) + "*"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    # another rank of this host still holds its copy: it removes the folder
    with contextlib.suppress(OSError):
        os.rmdir(folder(out_dir))


def sweep():
    """Remove the shared-memory folders whose out-dir no longer exists (their checkpoints are gone:
    a copy is only ever used against its out-dir's manifest). Returns them."""
    gone = []
    for where in glob.glob(os.path.join(SHM, "nanomega-*")):
        for made in glob.glob(os.path.join(where, "*.json"))[:1]:
            with contextlib.suppress(OSError, ValueError, KeyError):
                if not os.path.isdir(json.load(open(made))["out_dir"]):
                    shutil.rmtree(where, ignore_errors=True)
                    gone.append(where)
    return gone


class Copies:
    """This rank's copies in shared memory, for one out-dir: keep (after writing a shard), prune
    (once a newer checkpoint is complete), find (on resume), reset (after it)."""

    def __init__(self, out_dir, rank):
        self.out_dir, self.rank = os.path.realpath(out_dir), rank
        self.folder, self.prefix = folder(out_dir), prefix(out_dir, rank)
        self.off = None  # the error that turned copies off for this job (no room in /dev/shm, ...)
        # (step, sha256) -> the copy find verified: discovery's hash serves the restore too
        self.verified = {}
        sweep()

    def base(self, step):
        return f"{self.prefix}{step:06d}"

    def steps(self):
        """The steps of this rank's complete copies (those with their json), newest first."""
        return sorted(
            (int(p[len(self.prefix) : -5]) for p in glob.glob(self.prefix + "*.json")), reverse=True
        )

    def leftovers(self):
        """Removes this rank's half-written files: temporary names, and a copy without its json (a
        killed write)."""
        for path in glob.glob(self.prefix + "*"):
            if path.endswith(".tmp") or (
                path.endswith(".pt") and not os.path.isfile(path[:-3] + ".json")
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def keep(self, ckpt_folder):
        """Copy this rank's shard just written in ckpt_folder (checkpoint.write_shard) to shared
        memory; called before the manifest. A failure (no /dev/shm, no room in it) turns copies off
        for this job, one line."""
        if self.off is not None:
            return

        step = int(os.path.basename(ckpt_folder)[5:])
        shard = os.path.join(ckpt_folder, checkpoint.shard_name(self.rank))
        base = self.base(step)

        try:
            # write_shard's: sha256 and size of the bytes on disk
            made = json.load(open(shard[:-3] + ".json"))
            os.makedirs(self.folder, exist_ok=True)
            self.leftovers()
            self.prune()
            self.remove(step)  # a copy of this very step (a rollback saves a step again) is stale

            shutil.copyfile(shard, base + ".pt.tmp")
            if os.path.getsize(base + ".pt.tmp") != made["size"]:
                raise OSError(f"the copy of {shard} is short")
            os.replace(base + ".pt.tmp", base + ".pt")
            with open(base + ".json.tmp", "w") as f:
                json.dump(
                    dict(step=step, sha256=made["sha256"], size=made["size"], out_dir=self.out_dir),
                    f,
                )
            # last: a copy without its json is never used
            os.replace(base + ".json.tmp", base + ".json")
        except OSError as e:
            self.off = e
            self.remove(step)
            self.leftovers()
            print(
                f"--flash-restore: rank {self.rank}: no copy in {self.folder} ({e}); restores read the disk",
                file=sys.stderr,
                flush=True,
            )

    def prune(self):
        """Remove the copies older than the newest one whose checkpoint is complete (its
        manifest exists)."""
        steps = self.steps()
        done = next(
            (
                s
                for s in steps
                if os.path.isfile(
                    os.path.join(self.out_dir, "ckpt", f"step_{s:06d}", "manifest.json")
                )
            ),
            None,
        )
        for s in steps:
            if done is not None and s < done:
                self.remove(s)

    def remove(self, step):
        self.verified = {k: v for k, v in self.verified.items() if k[0] != step}
        for ext in (".json", ".pt"):  # the json first: a copy without it is not used
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.base(step) + ext)

    def find(self, manifest, name):
        """The path of this rank's copy of shard `name` of the checkpoint `manifest` describes, if
        its step is the manifest's and its bytes hash to the manifest's sha256 of that shard; else
        None (read the disk)."""
        step, digest = manifest["step"], manifest["shards"].get(name)
        if name != checkpoint.shard_name(self.rank) or digest is None:
            return None  # another rank's shard (another layout): the disk

        # hashed already (look, then the restore): only this rank writes it
        if (step, digest) in self.verified:
            return self.verified[step, digest]

        base = self.base(step)
        try:
            made = json.load(open(base + ".json"))
            if (
                made["step"] != step
                or made["sha256"] != digest
                or os.path.getsize(base + ".pt") != made["size"]
            ):
                return None
            if sha256_file(base + ".pt") != digest:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None

        self.verified[step, digest] = base + ".pt"
        return base + ".pt"

    def reset(self, step=None):
        """After a restore from this rank's copy of `step` (None: a fresh start, or a restore
        from disk): every other copy of this rank is of no use (older, of an abandoned
        timeline, or damaged)."""
        for s in self.steps():
            if s != step:
                self.remove(s)
        self.leftovers()


def count(grid, *flags):
    """For each flag, how many ranks of the grid say yes (one all-reduce over the world: grid.all,
    cp ranks too)."""
    t = torch.tensor([float(f) for f in flags], device=grid.device)
    grid.all.all_reduce(t)
    return tuple(int(v) for v in t.tolist())


@dataclasses.dataclass
class Found:
    """Fast discovery's pick before the grid's vote: the newest folder with a manifest (all its
    shards present with their sizes, saved under this layout), this rank's verified, finite copy of
    its own shard in it (or None), the folders skipped on the way (no manifest), and `full`: the
    full discovery, which every rank runs instead when any rank's verdict is no
    (faults.find_checkpoint sets it)."""

    folder: str
    manifest: dict
    copy: str | None
    skipped: list
    full: object = None


def look(out_dir, cfg, copies, layout, world):
    """Before any collective: (Found, None), or (None, why) when a manifest alone sends every rank
    to the full discovery (every rank reads the same manifest: the same verdict everywhere). Reads
    manifests, stats the shards on disk, and hashes only this rank's copy in shared memory; opens no
    shard file of the out-dir."""
    skipped = []
    for _, folder in checkpoint.step_folders(out_dir):
        name = os.path.basename(folder)
        try:
            # the json; each shard's presence, size
            manifest = checkpoint.read_manifest(folder, cfg, verify=set())
        except checkpoint.CorruptCheckpoint as e:
            if os.path.isfile(os.path.join(folder, "manifest.json")):
                # damaged: the full discovery names it and falls back past it
                return None, f"{name}: {e}"
            # a save that did not finish: skipped alike by the full discovery
            skipped.append(f"{name}: {e}")
            continue

        if manifest["layout"] != layout or manifest["world"] != world:
            return (
                None,
                f"{name} was saved under another layout (resharding reads other ranks' shards)",
            )

        path = copies.find(manifest, checkpoint.shard_name(copies.rank))
        if path and checkpoint.nonfinite(checkpoint.load_shard(folder, copies.rank, path)):
            # a diverged step's copy hashes fine: the full discovery refuses its folder, and says so
            path = None
        return Found(folder, manifest, path, skipped), None
    return None, "no step folder holds a manifest"


def agree(found, cfg, grid, engine):
    """After the grid exists, on every rank (collective): (how many ranks verified every shard
    they will load -- their own from its copy, and a peer's they also read (reshard.needed_by)
    on disk --, how many read a peer's shard from storage). One vote over the grid; found None:
    this rank says no."""
    # this rank found nothing to verify (--on-spike rollback: a manifest written meanwhile)
    if found is None:
        return count(grid, False, False)
    own = checkpoint.shard_name(grid.rank)
    peers = set(reshard.needed_by(found.manifest, cfg, engine, grid)) - {own}
    ok = found.copy is not None
    if ok and peers:
        try:
            checkpoint.read_manifest(found.folder, cfg, verify=peers)
        except checkpoint.CorruptCheckpoint:
            ok = False
    return count(grid, ok, ok and bool(peers))
