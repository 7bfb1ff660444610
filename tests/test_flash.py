"""Flash restore (issue 32, nanomega/flash.py): each rank's newest checkpoint shard also kept, byte
for byte, in shared memory (/dev/shm); a restarted rank reads its shard from there when step and
sha256 match, else from disk.

- a SIGKILLed rank under torchrun --max-restarts: both ranks find (fast discovery, one vote) and
  restore from shared memory (the log lines say so), the job ends bitwise equal to an uninterrupted
  run without the flag, and the copies are gone at its end; a job killed whole, restarted with one
  rank's copy gone: the vote sends every rank to the full discovery (a garbled disk shard skipped,
  said so), bitwise equal;
- in-process: with an intact copy neither discovery nor the restore opens a shard file of the
  out-dir (an audit hook; a garbled disk shard changes nothing), a copy with one flipped byte (or
  none) falls back to the full discovery, so does a resume under another layout; bitwise each time;
  a ZeRO-0 replica (2 spawned ranks) verifies the peer shard it reads before the vote; --on-spike
  rollback takes the fast path too;
- Copies: the previous copy stays until the newer checkpoint's manifest exists; no room in /dev/shm
  is one line.
"""

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from nanomega import checkpoint, flash, reshard, train, worlds

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import kill_resume  # noqa: E402  (the torchrun harness of tests/test_faults.py and lesson 19)

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--dropout",
    "0.1",
    "--eval-every",
    "0",
    "--peak-flops",
    "1e11",
    "--save-every",
    "2",
    "--max-steps",
    "6",
    "--warmup",
    "2",
    "--log-every",
    "1",
]


def run(corpus, out, *extra):
    return train.main(
        [
            *SMALL,
            "--corpus",
            str(corpus),
            "--data-cache",
            str(Path(corpus).parent / "cache"),
            "--out-dir",
            str(out),
            *extra,
        ]
    )


def same_weights(a, b):
    wa, wb = reshard.full_weights(a), reshard.full_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(corpus):
    out = Path(corpus).parent / "reference"
    run(corpus, out)  # uninterrupted, no --flash-restore
    return out / "ckpt" / "step_000006"


def test_sigkilled_rank_restores_from_shared_memory(corpus, tmp_path):
    """SIGKILL rank 1 at step >= 5 of 10 (a checkpoint every 2 steps, ZeRO-1, dropout on); torchrun
    restarts both workers and each reads its own shard of the newest checkpoint from its copy in
    /dev/shm."""
    extra = ["--zero", "1"]  # kill_resume.MODEL: dropout 0.1
    out = tmp_path / "killed" / "out"
    job = kill_resume.torchrun(corpus, out, 2, 10, [*extra, "--flash-restore"])
    seen = set()
    try:
        while kill_resume.logged_step(out) < 5 and job.poll() is None:
            if os.path.isdir(flash.folder(out)):
                seen |= set(os.listdir(flash.folder(out)))
            time.sleep(0.05)
        killed = kill_resume.worker_pids(job.pid).get(1)
        assert killed, "rank 1 was not found to kill"
        os.kill(killed, signal.SIGKILL)
        log, _ = job.communicate(timeout=600)
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 0, log[-3000:]
    assert (
        log.count("resumed from") == 1 and "restored from shared memory: 2 of 2 ranks\n" in log
    ), log[-3000:]
    assert (
        "verified by each rank from its shared-memory copy (no shard read from storage)\n" in log
    ), log[-3000:]
    # never killed, no --flash-restore
    reference = kill_resume.reference(corpus, tmp_path, 2, 10, extra)
    assert same_weights(checkpoint.latest(out), checkpoint.latest(reference))
    # the copies existed ...
    assert {n[:10] for n in seen if n.endswith(".pt")} == {"rank_00000", "rank_00001"}
    assert not os.path.exists(flash.folder(out))  # ... and went at the job's normal end


def gone(pid):
    try:
        # a zombie is gone too
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def test_one_rank_without_its_copy_sends_every_rank_to_full_discovery(corpus, tmp_path):
    """The vote: a 2-rank ZeRO-1 torchrun job is killed whole (its agent SIGKILLed: the copies stay
    in /dev/shm); rank 1's copy is removed and rank 0's disk shard of the newest checkpoint garbled
    (its copy intact). Rank 0 alone would pass the fast discovery; the vote sends both ranks to the
    full one, which skips that folder as corrupt and resumes from the one before, bitwise equal to
    an uninterrupted run."""
    extra = ["--zero", "1"]
    out = tmp_path / "whole" / "out"
    job = kill_resume.torchrun(corpus, out, 2, 10, [*extra, "--flash-restore"], restarts=0)
    try:
        while kill_resume.logged_step(out) < 5 and job.poll() is None:
            time.sleep(0.05)
        workers = kill_resume.worker_pids(job.pid)
        assert len(workers) == 2, "the workers were not found"
        # the agent: its workers die with it (lifecycle.die_with_parent)
        os.kill(job.pid, signal.SIGKILL)
        job.communicate(timeout=60)
        deadline = time.time() + 30
        while not all(gone(p) for p in workers.values()) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        job.kill()
        job.wait()
    newest = checkpoint.latest(out)
    step = checkpoint.read_manifest_json(newest)["step"]
    name = os.path.basename(newest)
    for path in Path(flash.folder(out)).glob("rank_00001.step_*"):
        path.unlink()  # rank 1 has no copy
    garble(newest)  # rank 0's copy still verifies; its disk shard does not
    resumed = kill_resume.torchrun(corpus, out, 2, 10, [*extra, "--flash-restore"], restarts=0)
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log[-3000:]
    assert f"1 of 2 ranks could not verify their shard of {name} from shared memory" in log, log[
        -3000:
    ]
    assert (
        f"resume: skipped {name}: shard {newest}/rank_00000.pt is missing or does not match" in log
    ), log[-3000:]
    assert f"resumed from {out}/ckpt/step_{step - 2:06d} at step {step - 2}" in log, log[-3000:]
    # never killed, no --flash-restore
    reference = kill_resume.reference(corpus, tmp_path, 2, 10, extra)
    assert same_weights(checkpoint.latest(out), checkpoint.latest(reference))
    assert not os.path.exists(flash.folder(out))


def failed_run(corpus, out, monkeypatch, *extra):
    """A run that raises at step 5 with a torchrun restart to follow: its copies in /dev/shm are
    kept."""
    with monkeypatch.context() as m:
        m.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
        with pytest.raises(RuntimeError, match="--inject-fault"):
            run(corpus, out, "--flash-restore", "--inject-fault", "raise:0:5", *extra)
    return sorted(os.listdir(flash.folder(out)))


class Reads:
    """What a resume reads: the shards the restore verifies on disk (reshard.load's read_manifest),
    the file of each shard loaded, and every shard file of the out-dir opened at all (an audit hook
    sees each open(): a hash, a torch.load) -- the proof that the fast discovery and its restore
    read no shard from storage."""

    def __init__(self, monkeypatch, out):
        self.verified, self.loaded, self.opened = [], [], []
        # the shards a resume may pick
        self.before = {str(p) for p in Path(out, "ckpt").glob("step_*/rank_*.pt")}
        read_manifest, load_shard = checkpoint.read_manifest, checkpoint.load_shard

        def spy_read_manifest(folder, cfg, verify=None):
            self.verified.append(verify)
            return read_manifest(folder, cfg, verify)

        def spy_load_shard(folder, rank, path=None):
            self.loaded.append(path or os.path.join(folder, checkpoint.shard_name(rank)))
            return load_shard(folder, rank, path)

        monkeypatch.setattr(checkpoint, "read_manifest", spy_read_manifest)
        monkeypatch.setattr(checkpoint, "load_shard", spy_load_shard)
        monkeypatch.setattr(Reads, "watching", self)

    # the Reads the audit hook reports to (one hook for the session: hooks cannot be removed)
    watching = None

    @staticmethod
    def hook(event, args):
        if event == "open" and Reads.watching and isinstance(args[0], (str, os.PathLike)):
            if os.fspath(args[0]) in Reads.watching.before:
                Reads.watching.opened.append(os.fspath(args[0]))


sys.addaudithook(Reads.hook)


def garble(folder):
    """Every shard file of a checkpoint folder overwritten with other bytes of the same size (a stat
    passes)."""
    for shard in Path(folder).glob("rank_*.pt"):
        shard.write_bytes(bytes(255 - b for b in shard.read_bytes()))


@pytest.mark.parametrize(
    "case", ["intact", "flipped", "intact-async", "disk-garbled", "disk-garbled-no-copy"]
)
def test_intact_copy_is_read_a_damaged_one_falls_back(
    corpus, reference, tmp_path, monkeypatch, capsys, case
):
    """An intact copy: discovery and restore open no shard file of the out-dir (a garbled disk shard
    changes nothing); a copy with a flipped byte, or none: the full discovery, which skips a garbled
    folder and says so."""
    out = tmp_path / "out"
    extra = ["--async-save"] if case.endswith("async") else []
    kept = failed_run(corpus, out, monkeypatch, *extra)
    # async: step 4's manifest may lag
    step = checkpoint.read_manifest_json(checkpoint.latest(out))["step"]
    copy = flash.folder(out) + f"/rank_00000.step_{step:06d}.pt"
    assert os.path.basename(copy) in kept
    if case == "flipped":
        data = bytearray(open(copy, "rb").read())
        data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, same json, another sha256
        open(copy, "wb").write(data)
    if case.startswith("disk-garbled"):
        garble(out / "ckpt" / f"step_{step:06d}")  # after the copies were made; sizes kept
    if case.endswith("no-copy"):
        os.remove(copy)
    reads = Reads(monkeypatch, out)
    capsys.readouterr()
    rec = run(corpus, out, "--flash-restore", "--resume", *extra)
    printed, verified, loaded, opened = (
        capsys.readouterr(),
        reads.verified,
        list(reads.loaded),
        reads.opened,
    )
    printed = printed.out + printed.err
    # bitwise each time
    assert rec["step"] == 6 and same_weights(out / "ckpt" / "step_000006", reference)
    name = f"step_{step:06d}"
    if case in ("flipped", "disk-garbled-no-copy"):
        assert (
            f"full discovery (every shard verified on disk): 1 of 1 ranks could not verify their shard of {name}"
            in printed
        ), printed
        assert str(out / "ckpt" / name / "rank_00000.pt") in opened  # hashed on disk
    if case == "flipped":
        assert "restored from shared memory: 0 of 1 ranks (1 read the disk)" in printed, printed
        assert verified[-1] == {"rank_00000.pt"} and loaded[-1] == str(
            out / "ckpt" / name / "rank_00000.pt"
        )
    # the full discovery skips the garbled folder, names it, resumes before it
    elif case == "disk-garbled-no-copy":
        assert (
            f"resume: skipped {name}: shard {out / 'ckpt' / name / 'rank_00000.pt'} is missing or does not "
            f"match its checksum"
            in printed
            and f"resumed from {out / 'ckpt' / 'step_000002'} at step 2" in printed
        )
    # neither discovery nor the restore opened a shard file of the out-dir: the copy's bytes hash to
    # the manifest's
    else:
        assert (
            f"resume: {name} verified by each rank from its shared-memory copy (no shard read from storage)\n"
            in printed
            and f"resumed from {out / 'ckpt' / name} at step {step}" in printed
        ), printed
        assert "restored from shared memory: 1 of 1 ranks\n" in printed, printed
        assert opened == [] and set(loaded) == {copy} and all(v == set() for v in verified), (
            opened,
            loaded,
        )
    assert not os.path.exists(flash.folder(out))  # a normal end removes the copies


def test_rollback_takes_the_fast_path(corpus, tmp_path, monkeypatch):
    """--on-spike rollback with --flash-restore: the checkpoint found by one vote and reloaded from
    the copy (no full discovery, no shard file loaded from the out-dir), the same run as the
    rollback without the flag."""
    flags = ["--inject-fault", "spike:0:4", "--on-spike", "rollback", "--rollback-lr-factor", "0.5"]
    run(corpus, tmp_path / "plain", *flags)
    full, loaded = [], []
    find_resume, load_shard = checkpoint.find_resume, checkpoint.load_shard
    monkeypatch.setattr(
        checkpoint, "find_resume", lambda *a, **k: full.append(a) or find_resume(*a, **k)
    )
    monkeypatch.setattr(
        checkpoint,
        "load_shard",
        lambda f, r, path=None: loaded.append(path) or load_shard(f, r, path),
    )
    run(corpus, tmp_path / "flash", "--flash-restore", *flags)
    assert (
        full == []
        and loaded
        and all(p and p.startswith(flash.folder(tmp_path / "flash")) for p in loaded)
    ), loaded
    assert same_weights(
        tmp_path / "flash" / "ckpt" / "step_000006", tmp_path / "plain" / "ckpt" / "step_000006"
    )


def _zero0_world(corpus, root):
    """One rank of a 2-rank ZeRO-0 world: a run preempted at step 5 whose copies stay (as for a
    restart), its --resume to step 6, and an uninterrupted run to 6. Returns (the resume's stdout,
    (out, plain))."""
    out, plain = Path(root) / "out", Path(root) / "plain"
    flash.drop = lambda out_dir, rank: None  # this process only: the copies of the first run stay
    # preempted: all ranks save step 5, exit
    run(corpus, out, "--flash-restore", "--inject-fault", "sigterm:0:5")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(corpus, out, "--flash-restore", "--resume")
    run(corpus, plain)
    return printed.getvalue(), (str(out), str(plain))


def test_zero0_replica_verifies_the_peer_shard_it_reads(corpus, tmp_path):
    """ZeRO-0, dp 2: rank 1 saved no pieces (a replica) and reads rank 0's shard; the fast discovery
    still takes every rank's own copy, rank 1 verifies that peer shard on disk before the vote (and
    says so)."""
    results = worlds.launch(_zero0_world, 2, str(corpus), str(tmp_path), timeout=240)
    printed, (out, plain) = results[1]  # the last rank logs
    assert (
        "resume: step_000005 verified by each rank from its shared-memory copy (1 rank(s) also read a peer's "
        "shard from storage)"
        in printed
        and "restored from shared memory: 2 of 2 ranks" in printed
    ), printed
    assert same_weights(Path(out) / "ckpt" / "step_000006", Path(plain) / "ckpt" / "step_000006")
    for rank in (0, 1):
        flash.drop(out, rank)


def test_another_layout_reads_the_disk(corpus, tmp_path, monkeypatch, capsys):
    """Copies intact, but the resume runs at ZeRO-1 (another layout: resharded): every shard from
    disk, and the same result as the same resume of a copy of the out-dir that never had copies in
    shared memory."""
    out, plain = tmp_path / "out", tmp_path / "plain"
    failed_run(corpus, out, monkeypatch)
    shutil.copytree(out, plain, ignore=shutil.ignore_patterns(".lock"))
    reads = Reads(monkeypatch, out)
    capsys.readouterr()
    run(corpus, out, "--flash-restore", "--resume", "--zero", "1")
    printed, loaded = capsys.readouterr().out, list(reads.loaded)
    assert "(resharded)" in printed and "restored from shared memory: 0 of 1 ranks" in printed, (
        printed
    )
    assert loaded == [str(out / "ckpt" / "step_000004" / "rank_00000.pt")]
    run(corpus, plain, "--resume", "--zero", "1")
    assert same_weights(out / "ckpt" / "step_000006", plain / "ckpt" / "step_000006")
    assert not os.path.exists(flash.folder(out))


def fake_save(out, step, payload, manifest=True):
    """A one-rank checkpoint folder as write_shard leaves it (shard + its json), with or without the
    manifest."""
    checkpoint.write_shard(str(out), step, {"payload": payload}, 0)
    folder = out / "ckpt" / f"step_{step:06d}"
    if manifest:
        made = json.load(open(folder / "rank_00000.json"))
        (folder / "manifest.json").write_text(
            json.dumps(dict(step=step, shards={"rank_00000.pt": made["sha256"]}))
        )
    return str(folder)


def test_copies_keep_prune_find(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    copies = flash.Copies(out, 0)
    try:
        copies.keep(fake_save(out, 2, torch.arange(1000.0)))
        # a save in flight: 2 stays
        copies.keep(fake_save(out, 4, torch.arange(1000.0) + 1, manifest=False))
        assert copies.steps() == [4, 2]
        copies.prune()
        assert copies.steps() == [4, 2]
        fake_save(out, 4, torch.arange(1000.0) + 1)  # its manifest now exists: the older copy goes
        copies.prune()
        assert copies.steps() == [4]
        manifest = json.load(open(out / "ckpt" / "step_000004" / "manifest.json"))
        assert copies.find(manifest, "rank_00000.pt") == copies.base(4) + ".pt"
        assert copies.find(manifest, "rank_00001.pt") is None  # another rank's shard: the disk
        assert copies.find(dict(manifest, step=2), "rank_00000.pt") is None  # another step
        assert torch.equal(
            checkpoint.load_shard(None, 0, copies.find(manifest, "rank_00000.pt"))["payload"],
            torch.arange(1000.0) + 1,
        )
        open(copies.base(4) + ".pt.tmp", "w").write("half")  # a killed copy's leftover
        copies.reset(4)
        assert sorted(os.listdir(flash.folder(out))) == [
            "rank_00000.step_000004.json",
            "rank_00000.step_000004.pt",
        ]

        def full(src, dst):
            open(dst, "w").write("x")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(shutil, "copyfile", full)
        copies.keep(fake_save(out, 6, torch.arange(10.0)))
        assert (
            "--flash-restore: rank 0: no copy in" in capsys.readouterr().err
            and copies.off is not None
        )
        assert copies.steps() == [4] and not os.path.exists(copies.base(6) + ".pt.tmp")
    finally:
        flash.drop(out, 0)
    assert not os.path.exists(flash.folder(out))
