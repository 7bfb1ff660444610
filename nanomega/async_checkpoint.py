"""--async-save: the shard written by a background thread while training goes on.

Idea: at the step boundary the state is only copied into CPU buffers (kept, reused by every later
save); one writer thread writes the shard (checkpoint.write_shard) while the next steps run; the
manifest comes once every rank's write has finished, so a crash mid-write leaves the previous
checkpoint the newest complete one. Training stalls for one memory copy of its shard.
Lesson: lessons/19-checkpoints-and-failures.md
"""

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nanomega import checkpoint


class AsyncSaver:
    """--async-save ("flash" checkpoints, as DLRover's and torch.distributed.checkpoint.async_save):
    at the step boundary the state is only copied to CPU memory; a writer thread (one, kept) writes
    the shard while training goes on; the manifest comes once every rank's write has finished
    (`poll` asks all ranks at each step boundary), so a crash mid-write leaves the previous
    checkpoint the newest complete one. One write in flight at a time.

    The state may hold views of live engine buffers (reshard.pieces(copy=False), i.e.
    reshard.export_by_name(engine, copy=False)): `start` copies each tensor, once, into a CPU buffer
    kept for its place in the state and reused by every later save (fresh memory costs a page fault
    per 4 KiB page, several times the copy itself: bench/RESULTS.md). So the training thread stalls
    for one memory copy of the shard, and the saver holds one shard of CPU memory.
    From a GPU the buffers are pinned and the copies asynchronous: the writer waits for them, not
    training."""

    # keep: as save's, on the writer thread
    def __init__(self, out_dir, cfg, grid, layout, keep=None):
        self.out_dir, self.cfg, self.grid, self.layout, self.keep = out_dir, cfg, grid, layout, keep
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nanomega-ckpt")
        # its one thread started now and kept: start() never waits for a new thread
        self.writer.submit(int)
        # the writer's jobs (futures) in flight
        self.shard, self.manifest, self.step = None, None, None
        self.buffers = {}  # place in the state (a path of keys) -> its CPU buffer

    def start(self, step, state, wrap=None):
        self.wait()  # the previous save is complete: its writer has finished with the buffers
        old, self.buffers = self.buffers, {}
        # the training step may overwrite the live buffers next
        state = self._snapshot(state, (), old)
        copied = None
        # a GPU source (pinned buffers only then)
        if any(b.is_pinned() for b in self.buffers.values()):
            copied = torch.cuda.Event()
            copied.record()  # after the device-to-host copies, on the stream that queued them
        self.step = step
        self.shard = self.writer.submit(self._write, step, state, copied, wrap)

    def _snapshot(self, obj, path, old):
        """`obj` with every tensor copied into its buffer (the one from the last save if shape and
        dtype match)."""
        if torch.is_tensor(obj):
            buf = old.get(path)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
            self.buffers[path] = buf
            return buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
        if isinstance(obj, dict):
            return {k: self._snapshot(v, path + (k,), old) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._snapshot(v, path + (i,), old) for i, v in enumerate(obj))
        return obj

    def _write(self, step, state, copied, wrap):
        if copied is not None:
            copied.synchronize()
        folder = checkpoint.write_shard(self.out_dir, step, state, self.grid.rank, wrap)
        if self.keep:
            self.keep(folder)

    def poll(self, anyone_busy):
        """At a step boundary (every rank): once no rank is still writing its shard -- the vote
        shows every shard on disk, as write_manifest's barrier would -- rank 0 writes the manifest
        in the background (no barrier, and its fsyncs off the training thread)."""
        if self.shard is not None and not anyone_busy(not self.shard.done()):
            self._finish(background=True)

    def wait(self):
        """Collective: finish the save in flight (writer joined, manifest written). Returns the
        folder, or None."""
        return self._finish(background=False)

    def _finish(self, background):
        shard, manifest, self.shard, self.manifest = self.shard, self.manifest, None, None
        for job in (manifest, shard):
            if job is not None:
                # waits; re-raises the writer's error (OSError: disk full ...) on this thread
                job.result()

        if shard is None:
            return None

        # the manifest: here, or on the writer thread once the shard is on disk (rank 0)
        folder = os.path.join(self.out_dir, "ckpt", f"step_{self.step:06d}")
        if not background:
            checkpoint.write_manifest(
                self.out_dir, folder, self.step, self.cfg, self.grid, self.layout
            )
        elif self.grid.rank == 0:
            self.manifest = self.writer.submit(
                checkpoint.manifest_and_pointer,
                self.out_dir,
                folder,
                self.step,
                self.cfg,
                self.grid.world,
                self.layout,
            )
        return folder
