"""`python nanomega/train.py ARGS` as many short processes, without an interpreter start each.

A refusal test runs train.py for well under a second of its own work, after ~3 s of importing
torch and nanomega. Here one server process imports them once (one OpenMP thread: no thread pool
exists to fork) and forks a child per run: the child takes the run's environment, points its fd 1
and 2 at files of its own, and runs nanomega/train.py as `__main__` (runpy: the script's own
body, `lifecycle.entrypoint(main)`, exactly what the command runs after its imports) and exits as
an interpreter does (its atexit handlers run, then its status is the exit code). Each run is
still its own process, with its own exit status, output and environment (RANK, WORLD_SIZE, ...);
what it no longer repeats is the import, which reads no flag and no environment variable.

    server = Server(); server.run([(argv, env), (argv, env)]) -> [(rc, stderr, stdout, seconds)]
    server.run([(argv, env)], module="nanomega.tools.plan")      # python -m nanomega.tools.plan
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The server: imports, says "ready", then per JSON line (a batch) forks each run at once, waits
# for all (a run past the timeout is killed: rc -9) and answers one JSON line of return codes
SERVER = r"""
import atexit, json, os, runpy, signal, sys, time
import nanomega.train  # noqa: F401  (torch and every nanomega module, imported once)
import torch.distributed.elastic.multiprocessing.errors  # noqa: F401  (lifecycle.entrypoint's)

print("ready", flush=True)

script = sys.argv[1]
for line in sys.stdin:
    batch = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pids = []
    for run in batch["runs"]:
        pid = os.fork()
        if pid == 0:
            os.environ.clear(); os.environ.update(run["env"])
            for fd, path in ((1, run["out"]), (2, run["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = [script, *run["argv"]]
            code = 0
            try:
                if run["module"]:  # `python -m MODULE`: argv[0] becomes the module's file
                    runpy.run_module(run["module"], run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as e:  # as the interpreter: sys.exit("text") prints it, status 1
                code = 0 if e.code is None else e.code
                if not isinstance(code, int):
                    print(code, file=sys.stderr); code = 1
            except BaseException:
                import traceback; traceback.print_exc(); code = 1
            atexit._run_exitfuncs()  # what an interpreter's exit runs (a lock's release, ...)
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    codes, deadline = {}, time.monotonic() + batch["timeout"]
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0); codes[pid] = -9
        time.sleep(0.02)
    print(json.dumps([codes[p] for p in pids]), flush=True)
"""


class Server:
    """One server process for a test module; `run` starts a batch of runs together."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, "nanomega/train.py"],
            cwd=ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.tmp = Path(tempfile.mkdtemp(prefix="forkrun-"))
        self.n, self.ready = 0, False

    def run(self, runs, timeout=60, module=None):
        """runs: [(argv, env)] -> [(returncode, stderr, stdout, seconds)], seconds from the fork
        to the last run's end (the server's imports done before: not a run's time). module: run
        `python -m module ARGV` instead of train.py (a module the server has not imported, or
        runpy warns on stderr)."""
        if not self.ready:
            assert self.proc.stdout.readline() == "ready\n", "tests/forkrun.py's server failed"
            self.ready = True
        batch = []
        for argv, env in runs:
            self.n += 1
            out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
            batch.append(dict(argv=argv, env=env, out=str(out), err=str(err), module=module))
        t0 = time.perf_counter()
        self.proc.stdin.write(json.dumps(dict(runs=batch, timeout=timeout)) + "\n")
        self.proc.stdin.flush()
        codes = json.loads(self.proc.stdout.readline())
        seconds = time.perf_counter() - t0
        return [
            (code, Path(r["err"]).read_text(), Path(r["out"]).read_text(), seconds)
            for code, r in zip(codes, batch)
        ]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
