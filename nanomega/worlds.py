"""Local worlds: N CPU ranks on this machine for tests, lessons and benchmarks (torchrun: for jobs).

`launch(fn, world, *args)` runs fn(*args) on `world` processes that each joined one gloo process
group (dist.init) and returns their results in rank order. The ranks fork from a forkserver that
imported torch and nanomega once. A rank that raises ends the world with RankFailed, whose fields
(rank, type, message) are what graders and tests read.
Lesson: lessons/03-collectives.md
"""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanomega.dist import init

PRELOAD = ["nanomega.train"]  # imported once by the forkserver: torch and every concept module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A local rank raised: which rank, the exception's type name and message as fields; its
    traceback is the text a person reads. Graders and tests read the fields, never the
    traceback's wording."""

    def __init__(self, rank, kind, message, trace):
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank, self.kind, self.message = rank, kind, message


def _worker(rank, world, port, fn, args, queue, threads, env):
    os.environ.clear()  # the caller's environment at launch, not the forkserver's at its start
    os.environ.update(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )

    torch.set_num_threads(threads)  # ranks share the cores: oversubscription makes everything crawl
    try:
        init(device="cpu", timeout_s=120)
        queue.put((rank, "ok", fn(*args)))
    except BaseException as e:
        # what was raised, as data: nobody downstream parses the traceback's text
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world, *args, timeout=300, threads=1):
    """Run fn(*args) on `world` local CPU ranks; return the ranks' results. Each rank gets the
    caller's environment as it is now (the forkserver's own is the one it started with); a free port
    per world; the first error or the timeout kills all."""
    forkserver = "forkserver" in mp.get_all_start_methods()  # not on Windows: spawn there
    ctx = mp.get_context("forkserver" if forkserver else "spawn")
    if forkserver:
        ctx.set_forkserver_preload(PRELOAD)  # before the server starts; later calls change nothing

    queue, port, env = ctx.Queue(), free_port(), dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world, port, fn, args, queue, threads, env), daemon=True
        )
        for r in range(world)
    ]

    for p in procs:
        p.start()

    results = {}
    try:
        while len(results) < world:
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RankFailed(rank, *value)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
