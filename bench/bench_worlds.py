"""What a local world costs to start: nanomega.worlds.launch (ranks forked from a forkserver that
imported torch and nanomega once) vs a spawned interpreter per rank (what launch did before), for an
empty function.

    python bench/bench_worlds.py --world 4 --repeats 5      # bench/RESULTS.md
Each row: seconds from the call to every rank's result, rank processes joined. The first forkserver
call includes starting the server (its imports); the rest reuse it, as the suite's worlds do.
"""

import argparse
import os
import sys
import time

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega import extension, worlds  # noqa: E402


def rank_of_world():
    return int(os.environ["RANK"])


def _spawned(rank, world, port, queue):
    """The old way: a fresh interpreter imports torch and nanomega, then joins the group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    from nanomega import dist

    dist.init(device="cpu", timeout_s=120)
    queue.put(rank)
    import torch.distributed

    torch.distributed.destroy_process_group()


def spawn_world(world):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), worlds.free_port()
    procs = [
        ctx.Process(target=_spawned, args=(r, world, port, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ranks = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return ranks


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"CPU {extension.cpu_summary()}; world {args.world}; an empty function")
    for i in range(args.repeats):
        s, ranks = timed(worlds.launch, rank_of_world, args.world)
        assert ranks == list(range(args.world))
        print(
            f"worlds.launch (forkserver){' incl. server start' if i == 0 else ''}: {s:6.2f} s",
            flush=True,
        )
    for _ in range(args.repeats):
        s, ranks = timed(spawn_world, args.world)
        assert ranks == list(range(args.world))
        print(f"spawn, an interpreter per rank:           {s:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
