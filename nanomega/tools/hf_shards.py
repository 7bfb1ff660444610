"""hf export by stream: a checkpoint written as Hugging Face's sharded safetensors, one shard at a
time, so a model larger than the host's memory exports.

Idea: transformers reads a large model as shards model-0000k-of-0000n.safetensors and an index,
model.safetensors.index.json ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}).
The export walks the transformers tensors in order (hf_weights.hf_tensors); each is made from its
nanomega parameters, read one at a time from the memory-mapped checkpoint (reshard.weight_reader);
a shard is written once the next tensor would pass max_shard_size, and dropped. The full model is
never held. One shard: model.safetensors alone, as save_pretrained writes it.
Formulas:
    shards   greedy in tensor order: a shard closes before the tensor that would pass the limit (a
             tensor larger than the limit has a shard of its own)
    memory   ~ the open shard + its bytes while written + one parameter (+ its k/v or gate/up
             parts); the checkpoint's and the shards' pages are the kernel's page cache
Lesson: lessons/02-the-modern-block.md
"""

import json
import os
from pathlib import Path

from nanomega import reshard
from nanomega.tools import hf_weights

INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 1024**3  # bytes; the size the Hub's large models are cut at


def write(folder, cfg, to, max_shard_size=MAX_SHARD_SIZE, extra=None):
    """Checkpoint `folder` (GPTConfig cfg) -> config.json + safetensors shards (+ their index) in
    `to`; extra: {name: tensor} the checkpoint keeps outside its weights (DeepSeek-V3's routing
    biases); returns the shards' file names."""
    from safetensors.torch import save_file

    hf_cfg, _, _ = hf_weights.hf_model(cfg)
    os.makedirs(to, exist_ok=True)
    hf_cfg.save_pretrained(to)  # config.json
    read, _ = reshard.weight_reader(folder)
    last = {}  # the parameter read last: k and v (gate and up) are cut from one

    def get(name):
        if name in (extra or {}):
            return extra[name]
        if name not in last:
            last.clear()
            last[name] = read(name)
        return last[name]

    # tensors into the open shard; written (and dropped) before one would pass the limit
    shard, size, parts, weight_map, total = {}, 0, [], {}, 0
    for name, ours, make in hf_weights.hf_tensors(cfg):
        t = make([get(n) for n in ours])
        if shard and size + t.nbytes > max_shard_size:
            parts.append(_flush(save_file, shard, to, len(parts), weight_map))
            shard, size = {}, 0
        shard[name], size, total = t, size + t.nbytes, total + t.nbytes
    parts.append(_flush(save_file, shard, to, len(parts), weight_map))

    # the final names: model.safetensors alone, or model-0000k-of-0000n with the index
    if len(parts) == 1:
        os.replace(Path(to) / parts[0], Path(to) / "model.safetensors")
        return ["model.safetensors"]
    names = {p: f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors" for k, p in enumerate(parts)}
    for part, final in names.items():
        os.replace(Path(to) / part, Path(to) / final)
    index = dict(
        metadata=dict(total_size=total), weight_map={k: names[f] for k, f in weight_map.items()}
    )
    (Path(to) / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(names.values())


def _flush(save_file, shard, to, k, weight_map):
    """Write one shard under a provisional name (the count is known at the end); returns it."""
    part = f".part-{k:05d}.safetensors"
    save_file(shard, str(Path(to) / part), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, part))
    return part
