"""`hf export` streams: a 31.6 MB Llama checkpoint written as 4 MiB safetensors shards with
model.safetensors.index.json, its peak host memory measured, and the index loaded by transformers.

What is measured, and why: the peak of the export process's anonymous resident memory (RssAnon in
/proc/self/status, sampled every millisecond by a thread, minus its value just before the export),
in a subprocess of its own with glibc returning large blocks to the kernel when freed
(MALLOC_MMAP_THRESHOLD_=65536). Anonymous memory is what the export allocates: tensors, the open
shard, safetensors' bytes. The memory-mapped checkpoint and the written shards are file pages, the
kernel's page cache, dropped under pressure: they do not bound the size of a model that exports
(tracemalloc would see neither: torch allocates outside Python's allocator).
Bound (derived): the open shard S, its serialized bytes S, the largest parameter P assembled and
its part cloned P: 2 S + 2 P (+ 2 MiB of allocator and interpreter slack). The same checkpoint
exported in memory (the whole model, then transformers' model) is measured beside it: above the
model's own size.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the hf extra (transformers, safetensors) is not installed"
)
import transformers  # noqa: E402

from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.tools import hf, hf_shards, sample  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
SHARD = 4 * MiB
CFG = dict(
    arch="llama",
    vocab_size=4096,
    block_size=64,
    n_layer=8,
    n_head=4,
    n_kv_head=2,
    n_embd=256,
    ffn_hidden=704,
    tie_embeddings=False,
)
# the export in a process of its own: RssAnon's peak over it, from just before it (bytes)
MEASURE = """
import json, sys, threading, time
import torch, transformers, safetensors.torch
from nanomega import checkpoint, reshard
from nanomega.tools import hf, hf_weights

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

out, to, how, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
hf_weights.hf_model(checkpoint.saved_model(out)[1])  # transformers' classes loaded first
peak, done = [anon()], []

def sample():
    while not done:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

base = anon()
watcher = threading.Thread(target=sample)
watcher.start()
if how == "stream":
    hf.export(out, to, shard)
else:  # the whole model in memory, then transformers' model
    folder, cfg, _, _ = checkpoint.saved_model(out)
    hf_weights.to_hf(reshard.full_weights(folder), cfg).save_pretrained(to)
done.append(1)
watcher.join()
print(json.dumps(dict(base=base, peak=max(peak[0], anon()))))
"""


def export_peak(out, to, how):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(out), str(to), how, str(SHARD)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    return m["peak"] - m["base"]


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RssAnon: Linux's /proc")
def test_export_streams_one_shard_at_a_time(tmp_path):
    cfg = GPTConfig(**CFG)
    model = GPT(cfg, seed=0).eval()
    weights = {k: t.detach() for k, t in model.state_dict().items()}
    out = tmp_path / "ckpt"
    hf.save_dense(out, cfg, weights, {})
    total = sum(t.numel() * 4 for t in weights.values())  # fp32 (the vocabulary is unpadded)
    largest = max(t.numel() * 4 for t in weights.values())

    streamed = export_peak(out, tmp_path / "stream", "stream")
    whole = export_peak(out, tmp_path / "whole", "whole")
    bound = 2 * SHARD + 2 * largest + 2 * MiB
    print(
        f"model {total / MiB:.1f} MiB, shards of {SHARD / MiB:.0f} MiB: peak anonymous memory "
        f"streamed {streamed / MiB:.1f} MiB (bound {bound / MiB:.1f}), in memory {whole / MiB:.1f}"
    )
    assert streamed < bound < total < whole

    # the shards and their index, as transformers writes them
    to = tmp_path / "stream"
    index = json.loads((to / hf_shards.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 7 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == total and not (to / "model.safetensors").exists()
    assert all((to / f).stat().st_size <= SHARD + 64 * 1024 for f in files)  # + its header
    assert sorted(f for f in os.listdir(to) if "safetensors" in f) == [*files, hf_shards.INDEX]

    # transformers loads the index: nanomega's logits; nanomega's checked import reads it too
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(to).eval()
    idx = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    ours, _ = sample.load_model(out)
    with torch.no_grad():
        ref = ours(idx)[..., :4096]
        assert (hf_model(idx).logits - ref).abs().max() < 1e-4
        assert (hf.load_pretrained(to)(idx)[..., :4096] - ref).abs().max() < 1e-4
