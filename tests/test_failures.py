"""Failures at scale (issue 16): each test names the defect it guards against, and fails without its
fix.

One reference run (6 steps, a checkpoint every 2) is shared; each test damages a copy of its
out-dir."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanomega.job import checks, faults, flags, saves
from nanomega import async_checkpoint, checkpoint, data, dist, reshard, train
from nanomega.tools import sample
from nanomega.job import health

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import kill_resume  # noqa: E402  (the torchrun harness)

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


@pytest.fixture(scope="module")
def reference(corpus):
    out = Path(corpus).parent / "reference"
    run(corpus, out)  # checkpoints at steps 2, 4, 6
    return out


def copy(reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def same_weights(a, b):
    wa, wb = reshard.full_weights(a), reshard.full_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def steps_logged(out):
    return [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]


def find_checkpoint(corpus, out, *extra):
    """The recipe's steps before any collective: the pure checks, then the checkpoint to resume
    from."""
    config = checks.check(
        flags.parse([*SMALL, "--corpus", str(corpus), "--out-dir", str(out), *extra])
    )
    sha256 = data.tokenizer_sha256(data.get_tokenizer(config.tokenizer))
    return faults.find_checkpoint(
        config.out_dir,
        flags.model_config(config),
        resume=config.resume,
        resume_from=config.resume_from,
        max_steps=config.max_steps,
        recorded=saves.layout(config, sha256),
        allowed=faults.overrides(config),
    )


def test_lost_pointer_resumes_from_the_step_folders(corpus, reference, tmp_path, capsys):
    """Defects 1 and 8: `latest` deleted -> --resume started at step 0 and overwrote step 2; metrics
    rows written after the checkpoint (steps 5, 6 here) were duplicated by the resumed run."""
    out = copy(reference, tmp_path)
    (out / "ckpt" / "latest").unlink()
    shutil.rmtree(out / "ckpt" / "step_000006")  # the run "crashed" after logging steps 5 and 6
    rec = run(corpus, out, "--resume")
    assert "resumed from" in capsys.readouterr().out and rec["step"] == 6
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]  # rows 5, 6 replaced, not duplicated
    assert same_weights(
        out / "ckpt" / "step_000006", reference / "ckpt" / "step_000006"
    )  # bitwise: same kernels


def test_corrupt_checkpoint_falls_back_and_is_named(corpus, reference, tmp_path, capsys):
    """Defects 2 and 5: a bad shard in the newest checkpoint -> fall back to the previous complete
    one, naming what was skipped; an empty manifest is named; --resume-from picks a step."""
    out = copy(reference, tmp_path)
    shard = out / "ckpt" / "step_000006" / "rank_00000.pt"
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    (out / "ckpt" / "step_000004" / "manifest.json").write_text(
        ""
    )  # a power loss before the data reached disk
    assert find_checkpoint(corpus, out, "--resume", "--max-steps", "8").endswith("step_000002")
    err = capsys.readouterr().err
    assert f"skipped step_000006: shard {shard} is missing or does not match its checksum" in err
    assert "step_000004/manifest.json is empty, truncated or not a manifest" in err
    with pytest.raises(ValueError, match="--resume-from 4: .*manifest.json is empty"):
        find_checkpoint(corpus, out, "--resume-from", "4")
    shutil.rmtree(out / "ckpt" / "step_000004")
    rec = run(corpus, out, "--resume-from", "2")  # resumes, moves the damaged step 6 aside (kept)
    assert rec["step"] == 6 and (out / "ckpt" / "abandoned" / "step_000006").is_dir()
    assert same_weights(out / "ckpt" / "step_000006", reference / "ckpt" / "step_000006")


def test_another_tokenizer_is_refused_and_tools_read_only_a_verified_checkpoint(
    corpus, reference, tmp_path, capsys
):
    """Issue 28, item 3: a checkpoint resumed with another tokenizer of the same size (two ids
    swapped) said "resumed from ..." and trained on: the resume compares the tokenizer's fingerprint
    now, with an explicit override. Item 4: sample.py and `hf export` followed the newest manifest:
    after a shard was damaged they read it anyway; they take the newest checkpoint that verifies
    now, naming the one skipped."""
    out = copy(reference, tmp_path)
    ranks = data.RANK_FILE.read_text().splitlines()  # "<base64 bytes> <id>" per line
    (a, i), (b, j) = ranks[300].split(), ranks[301].split()
    ranks[300], ranks[301] = f"{a} {j}", f"{b} {i}"
    other = (
        tmp_path / "tok" / "shakespeare-4k.tiktoken"
    )  # the same name and size: only the ids differ
    other.parent.mkdir()
    other.write_text("\n".join(ranks) + "\n")
    with pytest.raises(
        ValueError,
        match=r"trained with --tokenizer shakespeare-4k, not this --tokenizer .*"
        r"shakespeare-4k.tiktoken .*--allow-tokenizer-change",
    ):
        find_checkpoint(corpus, out, "--resume", "--max-steps", "8", "--tokenizer", str(other))
    assert find_checkpoint(
        corpus,
        out,
        "--resume",
        "--max-steps",
        "8",
        "--tokenizer",
        str(other),
        "--allow-tokenizer-change",
    ).endswith("step_000006")
    assert find_checkpoint(corpus, out, "--resume", "--max-steps", "8").endswith("step_000006")

    shard = out / "ckpt" / "step_000006" / "rank_00000.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(
        64
    )  # 64 bytes of the weights zeroed: the size is unchanged
    shard.write_bytes(bytes(raw))
    folder, _, _, skipped = checkpoint.saved_model(out)
    assert folder.endswith("step_000004") and skipped == [
        f"step_000006: shard {shard} is missing or does not match its checksum"
    ]
    capsys.readouterr()
    sample.main(["--out-dir", str(out), "--max-new-tokens", "4"])
    assert f"sample: skipped step_000006: shard {shard}" in capsys.readouterr().err


def test_keep_last_never_deletes_the_checkpoint_just_written(corpus, reference, tmp_path, capsys):
    """Issue 28, item 7: --keep-last 1 counted a damaged newer folder (one the resume had skipped)
    as the newest and deleted the checkpoint it had just written. Folders past the step saved are
    another timeline now."""
    out = copy(reference, tmp_path)
    stray = out / "ckpt" / "step_000010"
    shutil.copytree(out / "ckpt" / "step_000006", stray)
    (stray / "manifest.json").write_text("")  # damaged: --resume skips it and falls back to step 6
    rec = run(corpus, out, "--resume", "--max-steps", "8", "--keep-last", "1")
    assert rec["step"] == 8 and "skipped step_000010" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "ckpt").glob("step_*")) == [
        "step_000006",
        "step_000008",
        "step_000010",
    ]
    checkpoint.read_manifest(
        out / "ckpt" / "step_000008", flags.model_config(flags.parse(SMALL))
    )  # verifies


def test_fsync_tmp_cleanup_retention_and_max_steps(
    corpus, reference, tmp_path, monkeypatch, capsys
):
    """Defect 8: no fsync, `.tmp` leftovers, checkpoints piling up, resume with --max-steps at or
    below the checkpoint a silent no-op."""
    out = copy(reference, tmp_path)
    with pytest.raises(ValueError, match="--max-steps 6 is at or below the checkpoint's step 6"):
        run(corpus, out, "--resume")
    leftover = out / "ckpt" / "step_000006" / "rank_00000.pt.tmp"
    leftover.write_bytes(b"half a shard")
    synced = []
    real = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd)
    )
    run(corpus, out, "--resume", "--max-steps", "10", "--keep-last", "1", "--save-every", "2")
    assert not leftover.exists() and "removed" in capsys.readouterr().err
    left = sorted(os.listdir(out / "ckpt"))
    assert left == ["latest", "step_000006", "step_000010"]  # the newest, and the one resumed from
    ckpt = str((out / "ckpt").resolve())
    for path in (
        f"{ckpt}/step_000010/rank_00000.pt.tmp",
        f"{ckpt}/step_000010/manifest.json.tmp",
        f"{ckpt}/latest.tmp",
        f"{ckpt}/step_000010",
        ckpt,
    ):
        assert path in synced, f"{path} was not fsynced"


def test_divergence_stops_within_max_skipped(corpus, tmp_path):
    """Defect 3: --lr 1e6 skipped 28 of 30 steps and exited 0 with diverged checkpoints."""
    out = tmp_path / "lr1e6"
    with pytest.raises(FloatingPointError, match="4 consecutive steps skipped"):
        run(
            corpus,
            out,
            "--lr",
            "1e6",
            "--max-steps",
            "30",
            "--save-every",
            "2",
            "--max-skipped",
            "4",
        )
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    skipped = {r["step"] for r in recs if r["skipped"]}
    assert recs[-1]["skipped"] and all(r["skipped"] for r in recs[-4:]) and len(recs) < 30
    assert all(int(f[5:]) not in skipped for f in os.listdir(out / "ckpt") if f.startswith("step_"))


def test_preemption_checkpoints_and_resumes_bitwise(corpus, reference, tmp_path, capsys):
    """Defect 7 (no SIGTERM handling): a preempted job lost up to --save-every steps."""
    out = tmp_path / "preempted"
    rec = run(corpus, out, "--inject-fault", "sigterm:0:3")
    assert rec["step"] == 3 and (out / "ckpt" / "step_000003" / "manifest.json").exists()
    assert "preempted" in capsys.readouterr().err
    assert run(corpus, out, "--resume")["step"] == 6
    assert same_weights(out / "ckpt" / "step_000006", reference / "ckpt" / "step_000006")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the job


def test_bad_out_dir_and_timeout_refused_up_front(corpus, tmp_path):
    """Defect 6: --out-dir under a regular file failed with a traceback after start-up;
    --collective-timeout -1 gave a 99-line dump and 0 silently meant 300 s."""
    (tmp_path / "file").write_text("x")
    for extra, message in (
        (["--out-dir", str(tmp_path / "file" / "out")], "is a file, not a directory"),
        (["--collective-timeout", "0"], "--collective-timeout must be > 0"),
        (["--collective-timeout", "-1"], "--collective-timeout must be > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            checks.check(
                flags.parse(
                    [*SMALL, "--corpus", str(corpus), "--out-dir", str(tmp_path / "o"), *extra]
                )
            )


def test_second_job_on_an_out_dir_is_refused(corpus, tmp_path):
    """Defect 7: nothing stopped two jobs writing the same out-dir. The lock dies with its
    holder."""
    out = tmp_path / "locked"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from nanomega.job import lock; "
            "lock.lock_out_dir(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.time()
        with pytest.raises(
            ValueError, match=f"--out-dir {out} is in use by another job .pid {holder.pid}"
        ):
            run(corpus, out, "--max-steps", "1")
        assert time.time() - t0 < 10
        t0 = (
            time.time()
        )  # under torchrun: rank 0 refuses; rank 1, waiting in the rendezvous, dies on SIGTERM
        job = kill_resume.torchrun(corpus, out, 2, 4, restarts=0)
        log, _ = job.communicate(timeout=120)
        # < 30 s: torchrun's SIGTERM -> SIGKILL grace is 30 s, so a worker that sat out SIGTERM
        # takes longer
        assert (
            job.returncode != 0 and log.count("error: --out-dir") == 1 and time.time() - t0 < 30
        ), log[-3000:]
    finally:
        holder.kill()
        holder.wait()
    assert (
        run(corpus, out, "--max-steps", "1")["step"] == 1
    )  # the kernel released the dead holder's lock


def _lock_as(out, run_id, then, agent_env=None):
    """A process that takes out's lock as rank 0 of torchrun job `run_id` (restarts left), then runs
    `then`."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        RANK="0",
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="1",
    )
    code = (
        f"import os, sys; from nanomega.job import lock\ntry:\n    lock.lock_out_dir(sys.argv[1])\n"
        f"except ValueError as e:\n    print(e)\n    sys.exit(2)\n{then}"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=60
    )


def test_out_dir_lock_survives_a_torchrun_restart(tmp_path):
    """Issue 28: the lock died with rank 0, so while torchrun restarted the job another job could
    take the out-dir. Here this test process plays the torchrun agent (the workers' parent). Rank 0
    of job A locks and dies (os._exit: no cleanup, as a SIGKILL); job B is refused; A's restarted
    rank 0 adopts the lock from A's holder and ends normally, which frees it; job C then takes
    it."""
    out = tmp_path / "out"
    assert _lock_as(out, "A", "os._exit(1)").returncode == 1
    refused = _lock_as(out, "B", "print('locked')")
    assert (
        refused.returncode == 2
        and "in use by another job" in refused.stdout
        and "torchrun job A" in refused.stdout
    )
    restarted = _lock_as(out, "A", "print('adopted'); lock.unlock_out_dir(sys.argv[1])")
    assert restarted.returncode == 0 and "adopted" in restarted.stdout, (
        restarted.stdout + restarted.stderr
    )
    assert (
        _lock_as(out, "C", "print('locked'); lock.unlock_out_dir(sys.argv[1])").stdout.strip()
        == "locked"
    )


def test_workers_die_with_their_agent_and_errors_are_one_line(corpus, tmp_path):
    """Defects 6 and 7 under torchrun: SIGKILL of the agent left both workers training on as
    orphans; every rank printed the error and torchrun's summary lacked the message."""
    job = kill_resume.torchrun(
        corpus,
        tmp_path / "orphans",
        2,
        400,
        ["--save-every", "0", "--hang-timeout", "0"],
        restarts=0,
    )  # no watchdog: its store writes would end orphans too
    try:
        while kill_resume.logged_step(tmp_path / "orphans") < 1 and job.poll() is None:
            time.sleep(0.1)
        workers = kill_resume.worker_pids(job.pid)
        assert len(workers) == 2
        job.kill()  # SIGKILL: the agent cannot forward anything
        deadline = time.time() + 10
        while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in workers.values()):
            time.sleep(0.1)
        alive = [
            p
            for p in workers.values()
            if Path(f"/proc/{p}").exists() and open(f"/proc/{p}/stat").read().split()[2] != "Z"
        ]
        assert not alive, f"workers {alive} outlived their torchrun agent"
    finally:
        job.kill()
        job.wait()
        for p in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_frozen_rank_is_named_with_stack_dumps(corpus, tmp_path):
    """Defect 4: a frozen rank (SIGSTOP) was detected after 331 s and the report blamed the healthy
    rank 0; no watchdog, no stack dump. Here rank 1 stops itself at step 3; --hang-timeout 5."""
    out = tmp_path / "hang"
    job = kill_resume.torchrun(
        corpus,
        out,
        2,
        50,
        ["--inject-fault", "hang:1:3", "--hang-timeout", "5", "--collective-timeout", "120"],
        restarts=0,
    )
    workers = {}
    try:
        while not (out / "hang" / "report.txt").exists() and job.poll() is None:
            if (
                len(workers) < 2
            ):  # both ranks: the first read may come before torchrun started the second
                workers = kill_resume.worker_pids(job.pid)
            time.sleep(0.2)
        stalled_at = kill_resume.logged_step(out)
        report = (out / "hang" / "report.txt").read_text()
        assert (
            "ranks [1] did not answer (frozen or dead)" in report
            and "ranks [] did not reach" in report
        )
        assert (
            stalled_at == 2 and "File" in (out / "hang" / "rank_0.txt").read_text()
        )  # rank 0's Python stack
        os.kill(
            workers[1], signal.SIGKILL
        )  # else torchrun waits 30 s before it SIGKILLs the stopped rank
        log, _ = job.communicate(timeout=60)
        assert job.returncode != 0 and log.count("hang: no progress") == 1
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_frozen_in_a_save_is_named(corpus, tmp_path, mode):
    """Issue 28 item 6: SIGSTOP of rank 0 while it wrote a checkpoint gave no hang report -- the
    save ran with the watchdog paused -- and the job noticed only at the collective timeout, 136 s
    later. Now a save's beats are its shard's writes: rank 0 freezes at its first write of step 3's
    shard (--inject-fault hang-save); rank 1 finishes its shard and waits (sync: at the manifest's
    barrier; async: in step 4's collectives), and is named within --hang-timeout 5 plus the check-in
    grace, far inside --collective-timeout 120."""
    out = tmp_path / mode
    extra = ["--async-save"] if mode == "async" else []
    job = kill_resume.torchrun(
        corpus,
        out,
        2,
        50,
        [
            "--inject-fault",
            "hang-save:0:3",
            "--save-every",
            "3",
            "--hang-timeout",
            "5",
            "--collective-timeout",
            "120",
        ]
        + extra,
        restarts=0,
    )
    workers, frozen_at = {}, None
    try:
        while not (out / "hang" / "report.txt").exists() and job.poll() is None:
            if len(workers) < 2:
                workers = kill_resume.worker_pids(job.pid)
            if frozen_at is None and (out / "ckpt" / "step_000003" / "rank_00000.pt.tmp").exists():
                frozen_at = time.monotonic()  # rank 0's shard opened: it freezes at its first write
            time.sleep(0.2)
        named_after = time.monotonic() - frozen_at
        print(
            f"{mode}: rank 0 frozen in its save, named {named_after:.1f} s later (--hang-timeout 5)"
        )
        report = (out / "hang" / "report.txt").read_text()
        assert "ranks [0] did not answer (frozen or dead)" in report, report
        assert mode == "async" or "furthest: step 3 (saving)" in report, (
            report
        )  # async: rank 1 went on to step 4
        assert named_after < 5 + 2 + 10, (
            f"named {named_after:.1f} s after the freeze"
        )  # timeout + grace + slack
        assert not (
            out / "ckpt" / "step_000003" / "manifest.json"
        ).exists()  # the frozen save never completed
        os.kill(workers[0], signal.SIGKILL)
        log, _ = job.communicate(timeout=60)
        assert job.returncode != 0 and log.count("hang: no progress") == 1
    finally:
        job.kill()
        job.wait()


def test_spike_skip_and_rollback(corpus, reference, tmp_path, capsys):
    """--on-spike: skip drops the spiking step's update; rollback reloads the last checkpoint, skips
    the data since it, scales the lr, and the checkpoint records both (later resumes keep them)."""
    recs = lambda out: [json.loads(line) for line in open(out / "metrics.jsonl")]  # noqa: E731
    run(
        corpus,
        tmp_path / "skip",
        "--inject-fault",
        "spike:0:3",
        "--on-spike",
        "skip",
        "--max-steps",
        "4",
    )
    assert [r["skipped"] for r in recs(tmp_path / "skip")] == [False, False, True, False]
    out = tmp_path / "rollback"
    rec = run(
        corpus,
        out,
        "--inject-fault",
        "spike:0:4",
        "--on-spike",
        "rollback",
        "--rollback-lr-factor",
        "0.5",
    )
    assert (
        "step 4: loss spike; rolled back to step 2, the data of steps 3-4 skipped, lr x 0.5"
        in capsys.readouterr().err
    )
    assert rec["step"] == 6 and [r["step"] for r in recs(out)] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # rows 3, 4 redone
    assert recs(out)[2]["lr"] == 0.5 * train.lr_at(
        2, flags.parse(SMALL)
    )  # step 3 ran at half the lr
    state = checkpoint.load_shard(out / "ckpt" / "step_000006", 0)
    assert (
        state["spikes"] == dict(lr_scale=0.5, windows=[(3, 4)])
        and state["sampler"]
        != checkpoint.load_shard(reference / "ckpt" / "step_000006", 0)["sampler"]
    )  # two batches further on
    assert same_weights(out / "ckpt" / "step_000002", reference / "ckpt" / "step_000002")
    # --async-save: the rollback first completes the save in flight (its manifest is written in the
    # background), then the same run: the same checkpoint at step 6
    run(
        corpus,
        tmp_path / "async",
        "--inject-fault",
        "spike:0:4",
        "--on-spike",
        "rollback",
        "--rollback-lr-factor",
        "0.5",
        "--async-save",
    )
    assert same_weights(tmp_path / "async" / "ckpt" / "step_000006", out / "ckpt" / "step_000006")


def test_async_save_matches_and_a_failed_write_keeps_the_previous(
    corpus, reference, tmp_path, monkeypatch, grid
):
    """--async-save: the same checkpoints as a synchronous save (training went on from views of the
    live state); each tensor copied once at start() into a buffer reused by the next save; the
    manifest only after the write."""
    out = tmp_path / "async"
    run(corpus, out, "--async-save")
    for step in (2, 4, 6):
        assert same_weights(
            out / "ckpt" / f"step_{step:06d}", reference / "ckpt" / f"step_{step:06d}"
        )
    cfg = flags.model_config(flags.parse(SMALL))
    views, live, kept = (
        async_checkpoint.AsyncSaver(str(tmp_path / "views"), cfg, grid, {}),
        torch.arange(4.0),
        [],
    )
    for step in (1, 2):
        views.start(step, {"w": live[1:]})  # a view of live memory, as rank_state(copy=False) gives
        live += 1  # the next training step, while the writer may still be writing
        views.wait()
        kept.append(views.buffers[("w",)].data_ptr())
    assert [
        checkpoint.load_shard(tmp_path / "views" / "ckpt" / f"step_{s:06d}", 0)["w"].tolist()
        for s in (1, 2)
    ] == [[1, 2, 3], [2, 3, 4]] and kept[0] == kept[
        1
    ]  # copied at start(), into the same buffer each save
    saver = async_checkpoint.AsyncSaver(str(out), cfg, grid, {})
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    saver.start(8, {"step": 8})
    with pytest.raises(OSError, match="disk full"):
        saver.wait()
    assert (
        checkpoint.latest(out).endswith("step_000006")
        and not (out / "ckpt" / "step_000008" / "manifest.json").exists()
    )


@pytest.mark.parametrize("whom", ["agent", "every-process"])
def test_sigterm_to_torchrun_checkpoints_at_the_next_step(corpus, tmp_path, whom):
    """Defect 7 under torchrun: SIGTERM to the agent (a preemption) reaches the workers, which agree
    on one step boundary, checkpoint there and exit, within seconds (torchrun grants 30 s before its
    SIGKILL). every-process (issue 28, item 5): as Slurm's scancel, the workers are signalled too,
    so each gets the signal twice (its own, then the agent's forward, 20 ms later here); the second
    used to mean "stop now": no checkpoint. bench/bench_preempt.py runs it 10 times."""
    out = tmp_path / "preempt"
    job = kill_resume.torchrun(corpus, out, 2, 400, ["--save-every", "0"], restarts=0)
    try:
        while kill_resume.logged_step(out) < 3 and job.poll() is None:
            time.sleep(0.05)
        t0 = time.time()
        if whom == "every-process":
            for pid in kill_resume.worker_pids(job.pid).values():
                os.kill(pid, signal.SIGTERM)
            time.sleep(
                0.02
            )  # the agent's forward arrives before the step boundary: a second signal
        job.send_signal(signal.SIGTERM)
        log, _ = job.communicate(timeout=60)
        assert time.time() - t0 < 20 and log.count(": preempted (signal)") == 1
        step = checkpoint.read_manifest(
            checkpoint.latest(out), flags.model_config(flags.parse(SMALL))
        )["step"]
        assert step >= 3 and f"step {step}: preempted" in log
    finally:
        job.kill()
        job.wait()


def test_health_check_names_the_slow_rank(tmp_path):
    """Health check: rank 1 made 4x slower is named, the exit is non-zero; every rank agrees on the
    known sum."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "nanomega.job.health",
            "--slow-rank",
            "1",
            "--ranks-as-hosts",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert (
        p.returncode != 0 and "health: rank 1 (" in p.stderr and "health: rank 0" not in p.stderr
    ), p.stderr[-2000:]
    assert (
        "WRONG" not in p.stdout
        and "all-reduce on dp:" in p.stdout
        and "host pair rank0 - rank1:" in p.stdout
    )


def test_health_check_on_a_gpu_measures_bandwidth_not_launches(monkeypatch):
    """Issue 42 (low): a 256^3 matmul and a 1 MiB all-reduce time a GPU's kernel launches, not its
    compute or links; on CUDA the sizes are ~1 ms of an H100's matmul and a bandwidth-bound
    all-reduce. The command line picks the device as train.py does (it was always the CPU)."""
    assert health.sizes("cpu") == (256, 1 << 20)
    n, size = health.sizes("cuda")
    assert 2 * n**3 / 989e12 > 0.5e-3 and size >= 64 << 20  # H100 SXM's dense bf16 peak
    asked = []

    def init(device="auto", timeout_s=None):
        asked.append(device)
        raise SystemExit(0)

    monkeypatch.setattr(health.dist, "init", init)
    for argv, device in (([], "auto"), (["--device", "cuda"], "cuda")):
        with pytest.raises(SystemExit):
            health.main(argv)
        assert asked[-1] == device


def test_host_bisection_finds_the_slow_host():
    """DLRover's pairing: with a simulated link where host c is 5x slower, round 1 flags (c, d),
    round 2 re-pairs c and d with fast hosts and only c stays slow. Every rank must call pair_time
    in the same order."""
    calls = []

    def pair_time(a, b):
        calls.append((a, b))
        return 5.0 if "c" in (a, b) else 1.0

    bad, times = health.find_bad_hosts(["a", "b", "c", "d", "e"], pair_time)
    assert bad == ["c"] and calls[:3] == [("a", "b"), ("c", "d"), ("e", "a")] and len(calls) == 5
    assert (
        health.find_bad_hosts(["a", "b"], pair_time)[0] == []
    )  # one pair: nothing to compare with
    # two pairs (a, b), (c, a): judged against the faster one (lower median); their mean could never
    # be doubled
    assert health.find_bad_hosts(["a", "b", "c"], pair_time)[0] == ["c"]


def test_non_finite_weights_are_never_saved_nor_resumed(
    corpus, reference, tmp_path, monkeypatch, capsys
):
    """Issue 28, item 1: an update that made the weights non-finite (--lr inf, now refused by the
    flags; here an infinite lr injected at step 3) was saved with matching checksums and resumed
    from. Now the run stops before that save, and a planted non-finite checkpoint is refused by
    --resume, which falls back to the previous one."""
    real = train.lr_at
    monkeypatch.setattr(
        train, "lr_at", lambda step, config: float("inf") if step == 2 else real(step, config)
    )
    out = tmp_path / "inf"
    with pytest.raises(FloatingPointError, match="step 3: the update made the weights non-finite"):
        run(corpus, out, "--save-every", "1", "--max-steps", "4")
    assert sorted(os.listdir(out / "ckpt")) == ["latest", "step_000001", "step_000002"]
    monkeypatch.undo()

    out = copy(reference, tmp_path)  # plant NaN in step 6's masters, with checksums that match
    shard = out / "ckpt" / "step_000006" / "rank_00000.pt"
    state = torch.load(shard, weights_only=False)
    state["universal"]["pieces"][0]["master"][0] = float("nan")
    torch.save(state, shard)
    manifest = json.loads((shard.parent / "manifest.json").read_text())
    manifest["shards"][shard.name], manifest["sizes"][shard.name] = (
        data.sha256_file(shard),
        shard.stat().st_size,
    )
    (shard.parent / "manifest.json").write_text(json.dumps(manifest))
    assert find_checkpoint(corpus, out, "--resume", "--max-steps", "8").endswith("step_000004")
    name = state["universal"]["pieces"][0]["name"]
    assert (
        f"skipped step_000006: shard {shard} holds non-finite values (state/universal/pieces/{name}/master)"
        in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="--resume-from 6: .*holds non-finite values"):
        find_checkpoint(corpus, out, "--resume-from", "6")


def test_killed_data_preparation_leaves_nothing_behind(tmp_path):
    """Issue 28: a kill during data preparation left its temporary folder in the cache for ever. Now
    a folder being prepared is named data.TMP (host and pid), and the next job's rank 0 removes
    those whose process is gone -- never one still running (another rank's, or another job's)."""
    import socket

    cache = tmp_path / "cache"
    cache.mkdir()
    name = lambda pid: (
        data.TMP.format(name="corpus-abc-v1", host=socket.gethostname(), pid=pid) + "x1y2"
    )
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (cache / name(int(dead.stdout))).mkdir()  # its process has exited: left by a kill
    (cache / name(os.getpid())).mkdir()  # this process: still preparing
    (
        cache / name(int(dead.stdout)).replace(socket.gethostname(), "otherhost")
    ).mkdir()  # can't tell: kept
    (cache / "corpus-abc-v1").mkdir()  # a finished folder
    assert faults.clean_prepare(cache) == [str(cache / name(int(dead.stdout)))]
    assert len(list(cache.iterdir())) == 3


def test_full_disk_is_one_line_with_advice(corpus, tmp_path):
    """Issue 28: a full disk surfaced as `RuntimeError: [enforce fail at inline_container.cc:672] .
    unexpected pos ...` (torch's writer), differently on each rank, with no advice. Here the out-dir
    is a 1 MB tmpfs: the first checkpoint does not fit."""
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True
    ).returncode:
        pytest.skip(
            "cannot mount a tmpfs here (not root, or no mount namespace): no way to fill a disk safely"
        )
    try:
        p = subprocess.run(
            [
                sys.executable,
                "nanomega/train.py",
                *SMALL,
                "--corpus",
                str(corpus),
                "--data-cache",
                str(tmp_path / "cache"),
                "--out-dir",
                str(full / "out"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
    finally:
        subprocess.run(["umount", str(full)])
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and len(errors) == 1, p.stderr[-2000:]
    assert (
        errors[0].startswith(
            f"error: rank 0: no space left on the device of {full / 'out'}/ckpt/step_000002/"
        )
        and "lower --keep-last or choose another --out-dir" in errors[0]
    ), errors[0]


def test_a_long_save_is_not_a_hang_while_another_rank_writes(tmp_path, monkeypatch):
    """The other side of item 6: a save longer than --hang-timeout (a big shard, a slow disk) must
    not be called a hang, neither on the rank writing it nor on a rank that finished its own shard
    and waits at the manifest's barrier. This rank waits (no writes of its own) while a second
    thread plays a rank still writing, a write counted every 0.1 s for 3 s, three --hang-timeouts of
    1 s: no report. Then the writer stops (frozen): a report after about one timeout."""
    from nanomega.job import guard

    store = torch.distributed.HashStore()
    monkeypatch.setattr(dist, "store", lambda: store)
    reports = []
    monkeypatch.setattr(
        guard.Watchdog, "_report", lambda self: (reports.append(time.monotonic()), self.stop())
    )
    grid = type("Grid", (), dict(rank=0, world=2))()
    watchdog = guard.Watchdog(grid, 1.0, str(tmp_path))
    other = guard.Watchdog(
        type("Grid", (), dict(rank=1, world=2))(), 0.1, str(tmp_path)
    )  # its ticks: the store
    other.stop()  # only its tick() is used, not its thread
    try:
        watchdog.beat(1, "start")
        watchdog.beat(1, "backward done")  # a step done: armed (the next test)
        with watchdog.saving(step=1):
            with other.saving(step=1):
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3.0:
                    other.tick()
                    time.sleep(0.1)
            assert not reports, "called a hang while another rank was still writing its shard"
            stopped = time.monotonic()
            while not reports and time.monotonic() - stopped < 10:
                time.sleep(0.05)
    finally:
        watchdog.stop()
    assert reports and 0.9 < reports[0] - stopped < 3.0, (
        "a rank frozen in its save was not reported in time"
    )


def test_the_watchdog_is_armed_after_the_first_step(tmp_path, monkeypatch):
    """Issue 27 item 5: the watchdog was armed before the step-0 evaluation and the first step, so a
    cold --compile on ranks sharing cores (minutes) ended the job as a hang. Now it is armed once
    the first step's backward is done: 3 silent timeouts before it, no report; after it, a report
    within about one timeout."""
    from nanomega.job import guard

    monkeypatch.setattr(dist, "store", lambda: torch.distributed.HashStore())
    reports = []
    monkeypatch.setattr(
        guard.Watchdog, "_report", lambda self: (reports.append(time.monotonic()), self.stop())
    )
    watchdog = guard.Watchdog(type("Grid", (), dict(rank=0, world=1))(), 0.5, str(tmp_path))
    try:
        time.sleep(1.5)  # the step-0 evaluation, say
        watchdog.beat(1, "start")
        time.sleep(1.5)  # the first forward and backward: compiling
        assert not reports, "a hang reported during the warm-up"
        watchdog.beat(1, "backward done")
        watchdog.beat(2, "start")  # armed: the first step is done
        armed = time.monotonic()
        while not reports and time.monotonic() - armed < 5:
            time.sleep(0.05)
    finally:
        watchdog.stop()
    assert reports and 0.4 < reports[0] - armed < 2.0
