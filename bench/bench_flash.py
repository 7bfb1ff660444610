"""Flash restore (issue 32): the time to restore one rank's checkpoint shard from its copy in shared
memory (/dev/shm) vs from the disk, with the page cache dropped (root: `sync; echo 3 >
/proc/sys/vm/drop_caches`) and warm; what the copy costs at each save; and what discovery costs: the
fast one of --flash-restore (the manifest, a stat of each shard, this rank's copy hashed and checked
finite in memory: flash.look) vs the full one (checkpoint.find_resume: every shard hashed and loaded
on disk, on every rank).

    python bench/bench_flash.py                      # a ~370 MB shard: 4 layers x 768 wide, fp32 + AdamW
    python bench/bench_flash.py --n-layer 8          # ~740 MB
    python bench/bench_flash.py --world 8            # discovery over a checkpoint of 8 such shards

Every timing is the median of --repeats runs of the real code path: reshard.load (verify, read,
rebuild, import into a ZeRO engine) with and without flash.Copies.find, and the file part alone
(verify + read every byte); the copy's hash is not memoized across repeats (Copies.verified
cleared). Discovery runs on a checkpoint of --world shards (rank 0's, written --world times: the
bytes a --world-rank job's discovery hashes on every rank).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from nanomega import checkpoint, dist, extension, flash, reshard, zero  # noqa: E402
from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.model import GPT  # noqa: E402


def drop_caches():
    """True if the page cache was dropped (root), else False: the disk numbers are then
    page-cached."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn, repeats, before=None):
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touch(state):
    """Read every byte of a loaded (memory-mapped) shard: what the restore's copies into the engine
    do."""
    if torch.is_tensor(state):
        state.clone()
    elif isinstance(state, dict):
        for v in state.values():
            touch(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            touch(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--world", type=int, default=4, help="shards in the checkpoint discovery verifies"
    )
    p.add_argument(
        "--out", default=None, help="the out-dir (default: a new folder under /tmp, on its disk)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init("cpu")
    grid = dist.Grid(1, 1, 1)
    cfg = GPTConfig(
        vocab_size=4096, block_size=128, n_layer=args.n_layer, n_head=12, n_embd=args.n_embd
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zero.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), grid, 1)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
    model(x, x).backward()
    engine.step()  # Adam's m and v exist: the shard holds master + 2 states per parameter
    n_params = sum(p.numel() for p in model.parameters())
    state = dict(universal=reshard.pieces(engine, grid), step=1)
    out = args.out or tempfile.mkdtemp(prefix="bench_flash-", dir="/tmp")
    copies = flash.Copies(out, 0)
    layout = {}
    try:
        t0 = time.perf_counter()
        folder = checkpoint.write_shard(out, 1, state, 0)
        write = time.perf_counter() - t0
        keep = timed(lambda: copies.keep(folder), args.repeats)  # the extra work of every save
        checkpoint.write_manifest(out, folder, 1, cfg, grid, layout)
        name, size = (
            checkpoint.shard_name(0),
            os.path.getsize(os.path.join(folder, checkpoint.shard_name(0))),
        )
        manifest = checkpoint.read_manifest_json(folder)
        print(f"cpu: {extension.cpu_summary()}; torch {torch.__version__}; 1 thread")
        df = ["df", "--output=source", out]
        device = subprocess.run(df, capture_output=True, text=True).stdout.split()[-1]
        print(
            f"shard: {n_params:,} parameters ({args.n_layer} layers x {args.n_embd}), "
            f"{size / 1e6:.0f} MB (fp32 master + AdamW m, v); out-dir on {device}"
        )
        print(
            f"save: write_shard {write:.2f} s (torch.save + fsync + sha256); copy to {copies.folder} "
            f"{keep:.3f} s ({size / keep / 1e9:.2f} GB/s) per save"
        )
        cold = drop_caches()
        if not cold:
            print(
                "the page cache could not be dropped (not root): every disk number below is page-cached"
            )

        def disk_file():
            # sha256 + finiteness, as reshard.load
            checkpoint.read_manifest(folder, cfg, verify={name})
            touch(checkpoint.load_shard(folder, 0))

        def shm_file():
            touch(checkpoint.load_shard(folder, 0, copies.find(manifest, name)))

        fresh = copies.verified.clear  # each repeat hashes the copy, as a restarted process does
        rows = [
            (
                "file: verify + read",
                {
                    "shm": timed(shm_file, args.repeats, fresh),
                    "disk, cold": timed(disk_file, args.repeats, drop_caches) if cold else None,
                    "disk, page-cached": timed(disk_file, args.repeats),
                },
            )
        ]
        rows.append(
            (
                "reshard.load (+ rebuild, import)",
                {
                    "shm": timed(
                        lambda: reshard.load(folder, cfg, engine, grid, layout, copies.find),
                        args.repeats,
                        fresh,
                    ),
                    "disk, cold": timed(
                        lambda: reshard.load(folder, cfg, engine, grid, layout),
                        args.repeats,
                        drop_caches,
                    )
                    if cold
                    else None,
                    "disk, page-cached": timed(
                        lambda: reshard.load(folder, cfg, engine, grid, layout), args.repeats
                    ),
                },
            )
        )
        assert reshard.load(folder, cfg, engine, grid, layout, copies.find)["copies"] == [name]
        # the other ranks' shards (rank 0's bytes: the same size and work)
        for rank in range(1, args.world):
            checkpoint.write_shard(out, 1, state, rank)
        # write_manifest's grid
        world = types.SimpleNamespace(rank=0, world=args.world, barrier=lambda: None)
        # now a checkpoint of --world shards
        checkpoint.write_manifest(out, folder, 1, cfg, world, layout)

        # one rank's fast discovery: the manifest, a stat of each shard, its copy hashed, finite
        def fast():
            assert (
                flash.look(out, cfg, copies, layout, args.world)[0].copy == copies.base(1) + ".pt"
            )

        rows.append(
            (
                f"discovery, {args.world} shards: flash.look / find_resume",
                {
                    "shm": timed(fast, args.repeats, fresh),
                    "disk, cold": timed(
                        lambda: checkpoint.find_resume(out, cfg), args.repeats, drop_caches
                    )
                    if cold
                    else None,
                    "disk, page-cached": timed(
                        lambda: checkpoint.find_resume(out, cfg), args.repeats
                    ),
                },
            )
        )
        print(
            f"{'median of ' + str(args.repeats):<46} {'shm':>8} {'disk, cold':>11} {'disk, cached':>13}"
        )
        for label, t in rows:
            cells = [
                f"{t[k]:.3f} s" if t[k] is not None else "-"
                for k in ("shm", "disk, cold", "disk, page-cached")
            ]
            print(f"{label:<46} {cells[0]:>8} {cells[1]:>11} {cells[2]:>13}")
        print(f"load: {open('/proc/loadavg').read().split()[:3]}")
    finally:
        flash.drop(out, 0)
        if not args.out:
            subprocess.run(["rm", "-rf", out])


if __name__ == "__main__":
    main()
