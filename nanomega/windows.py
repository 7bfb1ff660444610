"""Token windows and the order they are read in: a deterministic, resumable stream of batches.

Idea: a sample is a window of block_size+1 tokens (inputs and their next-token targets) of a flat
token file (data.py prepares one, tools/corpus.py shards). The order of the windows depends only on
(seed, step), so a resumed run sees exactly the batches an uninterrupted one would have, and every
data-parallel rank computes its own share without communicating.

Formulas (T = block_size, N tokens, B = global batch, d = dp size, m = micro batch, a = grad accum):
    window i      = tokens[i*T : i*T + T + 1]  (stride T: windows share one token)
    n_windows     = (N - 1) // T
    stream        = perm_0 ++ perm_1 ++ ...,  perm_e = default_rng([seed, e]).permutation(n_windows)
    step k        = stream[k*B : (k+1)*B],  B = m * a * d
    dp rank r     = step k [r*m*a : (r+1)*m*a], cut into a micro-batches of m windows
Lesson: lessons/01-dense-model.md
"""

from pathlib import Path

import numpy as np
import torch


class TokenDataset:
    """The windows of one split: window i = tokens[i*T : i*T+T+1], len() = (N-1) // T (see the top).
    Given several shards (corpus.py), windows never cross a shard: shard k holds (N_k - 1) // T of
    them and the global window index runs over shard 0's, then shard 1's, ... (one Sampler spans
    them all)."""

    def __init__(self, path_bin, dtype, block_size: int):
        paths = [Path(p) for p in ([path_bin] if isinstance(path_bin, (str, Path)) else path_bin)]
        dtype = np.dtype(dtype)
        if block_size < 1:
            raise ValueError(f"--block-size {block_size} must be >= 1")

        self.tokens, counts = [], []
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(f"token file {path} is missing; prepare the data again")
            size = path.stat().st_size
            if size % dtype.itemsize:
                raise ValueError(
                    f"{path} has {size} bytes, not a whole number of {dtype.name} tokens: "
                    f"truncated; delete its folder and prepare again"
                )
            if size:
                self.tokens.append(np.memmap(path, dtype=dtype, mode="r"))  # (N_k,), read lazily
                counts.append((size // dtype.itemsize - 1) // block_size)

        n_tokens = sum(len(t) for t in self.tokens)
        split = {"train": "training", "val": "validation"}.get(
            paths[0].stem.split("_")[0], paths[0].name
        )
        if sum(counts) < 1:  # one window needs T inputs and their T targets
            raise ValueError(
                f"--block-size {block_size} is larger than the {split} split ({n_tokens} tokens); "
                f"use a smaller --block-size"
            )

        self.block_size = block_size
        self.starts = np.cumsum([0] + counts)  # (shards + 1,): first global window of each shard
        self.n_windows = int(self.starts[-1])

    def __len__(self) -> int:
        return self.n_windows

    def get(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 of shape (b, T) for window indices (b,); y[:, t] is the token after x[:,
        t]."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_windows):
            raise IndexError(f"window index out of range [0, {self.n_windows})")
        shard = np.searchsorted(self.starts, idx, side="right") - 1  # (b,)
        # (b, T+1)
        offsets = (idx - self.starts[shard])[:, None] * self.block_size + np.arange(
            self.block_size + 1
        )
        w = np.stack([self.tokens[k][o] for k, o in zip(shard, offsets)]) if idx.size else offsets
        w = torch.from_numpy(w.astype(np.int64))  # (b, T+1)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class Sampler:
    """Which windows make up global batch k: a pure function of (seed, k), plus a resumable
    position."""

    def __init__(self, n_windows: int, global_batch: int, seed: int):
        if n_windows < 1 or global_batch < 1:
            raise ValueError(
                f"need n_windows >= 1 and --global-batch >= 1, got {n_windows} and {global_batch}"
            )
        self.n_windows, self.global_batch, self.seed, self.samples_consumed = (
            n_windows,
            global_batch,
            seed,
            0,
        )
        # epoch -> permutation; at most two live (a batch can straddle an epoch end)
        self._perms = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
                self.n_windows
            )
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Window indices (B,) of global batch `step`: stream samples [step*B, (step+1)*B)."""
        out = np.empty(self.global_batch, dtype=np.int64)
        pos, filled = step * self.global_batch, 0
        while filled < self.global_batch:
            epoch, off = divmod(pos, self.n_windows)
            take = min(self.global_batch - filled, self.n_windows - off)
            out[filled : filled + take] = self._perm(epoch)[off : off + take]
            pos, filled = pos + take, filled + take
        return out

    def local_micro_batches(
        self, step: int, dp_rank: int, dp_size: int, micro_batch: int, grad_accum: int
    ) -> list[np.ndarray]:
        """This dp rank's contiguous slice of batch `step`, as grad_accum arrays of micro_batch
        indices."""
        if micro_batch * grad_accum * dp_size != self.global_batch:
            raise ValueError(
                f"--global-batch {self.global_batch} != --micro-batch {micro_batch} x grad accum "
                f"{grad_accum} x dp {dp_size}; pick a global batch divisible by micro-batch x dp"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        per_rank = micro_batch * grad_accum
        local = self.indices(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return list(local.reshape(grad_accum, micro_batch))

    @property
    def step(self) -> int:
        """The next step to run: the trainer asks for indices(sampler.step), trains, then
        advance()."""
        return self.samples_consumed // self.global_batch

    def advance(self) -> None:
        self.samples_consumed += self.global_batch

    def state_dict(self) -> dict:
        return {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "n_windows": self.n_windows,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, flag in (
            ("seed", "--seed"),
            ("global_batch", "--global-batch"),
            ("n_windows", "--corpus/--tokenizer/--block-size"),
        ):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data stream has {key}={state[key]}, this run "
                    f"{getattr(self, key)}: resume with the same {flag}"
                )
        self.samples_consumed = int(state["samples_consumed"])
