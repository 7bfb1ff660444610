"""Dropout random streams under tensor parallelism (the idea of Megatron's CUDA RNG tracker).

Idea: a replicated activation must get the SAME dropout mask on every tp rank, or the replicas drift
apart; a sharded one (a rank's heads; under sequence parallelism its slice of the sequence) a
DIFFERENT mask per rank. Two streams: torch's default generator, seeded alike on the tp group, and
inside RNGTracker.fork a generator seeded from (a draw of the default stream, tp rank). The tp
stream keeps no state of its own, so recompute and a resumed checkpoint replay the same masks.
Formula (the seeds):  default stream  seed + 100 pp_rank      tp stream  u * MAX_TP + tp_rank
Lessons: lessons/05-tensor-parallel.md, lessons/06-sequence-parallel.md
"""

from contextlib import contextmanager

import torch
import torch.nn as nn

MAX_TP = 4096  # seeds u * MAX_TP + tp_rank are distinct per (draw, rank)


def _get_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state, device):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def save_state(device) -> dict:
    """The generators a resume must continue: the CPU one and, on CUDA, this rank's device's (only
    its own: touching every GPU would open a context on each)."""
    return dict(
        rng=torch.get_rng_state(), cuda_rng=_get_state(device) if device.type == "cuda" else None
    )


def restore_state(state: dict, device) -> None:
    """Set back what save_state saved: a resume with dropout continues the same random streams,
    bitwise."""
    torch.set_rng_state(state["rng"])
    cuda = state.get("cuda_rng")
    if device.type == "cuda" and cuda is not None:
        _set_state(cuda[device.index or 0] if isinstance(cuda, (list, tuple)) else cuda, device)


class RNGTracker:
    """Swaps a per-tp-rank generator in for the dropout of sharded activations (see the module
    docstring)."""

    def __init__(self, tp_rank: int, device: torch.device):
        if not 0 <= tp_rank < MAX_TP:
            raise ValueError(f"tp rank {tp_rank} outside [0, {MAX_TP}); --tp is at most {MAX_TP}")
        self.tp_rank, self.device = tp_rank, torch.device(device)

    @contextmanager
    def fork(self):
        # CPU default stream: the same draw on every tp rank, no device sync
        u = int(torch.randint(1 << 48, ()))
        outer = _get_state(self.device)
        _set_state(
            torch.Generator(self.device).manual_seed(u * MAX_TP + self.tp_rank).get_state(),
            self.device,
        )
        try:
            yield
        finally:
            _set_state(outer, self.device)


def model_parallel_seed(seed: int, grid) -> RNGTracker:
    """Seed the default stream (the same on the tp group) and return this rank's tracker.

    Call it after every rank has built the dense model from `seed` (the init must be the same
    everywhere), and pass the tracker to tp.apply_tensor_parallel(..., rng=tracker).
    """
    torch.manual_seed(seed + 100 * grid.pp_rank)
    return RNGTracker(grid.tp_rank, grid.device)


class TrackedDropout(nn.Dropout):
    """nn.Dropout whose mask comes from the per-tp-rank stream (for sharded activations)."""

    def __init__(self, p: float, rng: RNGTracker):
        super().__init__(p)
        self.rng = rng

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.rng.fork():
            return super().forward(x)
