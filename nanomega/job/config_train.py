"""The training flags: the tokens and the batch, AdamW (or Muon, 1-bit Adam) and its schedule, and the
layout (tp x pp x cp x ep x dp, ZeRO, its schedule). One field per flag (job/section.py).
Lesson: lessons/15-3d-parallelism.md
"""

import dataclasses
import os

from nanomega.job.ranges import MAX_SEED, above, at_least
from nanomega.job.section import DATA, OPTIMIZER, PARALLEL, REPO


@dataclasses.dataclass(frozen=True)
class TrainFlags:
    """The data, the optimizer and schedule, the layout."""

    # the tokens and the batch
    tokenizer: str = DATA(
        "shakespeare-4k",
        "shakespeare-4k (ours), a tiktoken encoding available offline, or a .tiktoken file",
    )
    corpus: str = DATA(
        os.path.join(REPO, "data", "shakespeare.txt.gz"),
        "a file, directory or glob of .txt[.gz] / .jsonl[.gz] (one .txt: split at its last 5%%)",
    )
    text_field: str = DATA("text", "the JSON field with a document's text (.jsonl)")
    data: str | None = DATA(
        None, "shards prepared by `python -m nanomega.tools.corpus` (instead of --corpus)"
    )
    data_cache: str | None = DATA(None, "tokenized memmaps (default: OUT/data)")
    document_mask: bool = DATA(
        False,
        "a token attends only inside its own document of the packed window (documents end with "
        "<|endoftext|>; nanomega/documents.py)",
    )
    batch_size: int = DATA(16, "micro-batch size", at_least(1))
    grad_accum: int = DATA(
        1,
        "micro-batches per step per data-parallel rank (the pipeline's m)",
        at_least(1),
        names=("--grad-accum", "--microbatches"),
    )
    global_batch: int | None = DATA(
        None,
        "sequences per optimizer step; sets --grad-accum to global / (batch-size x dp), so a "
        "resume under another world size keeps the data order and the optimizer's view",
    )  # its range needs dp: checks.check

    # AdamW and its cosine schedule
    lr: float = OPTIMIZER(1e-3, "peak learning rate (AdamW, betas 0.9, 0.95)", above(0))
    min_lr: float = OPTIMIZER(
        1e-4,
        "learning rate at the end of the cosine decay",
        (lambda v, c: 0 <= v <= c.lr, "in [0, --lr {c.lr:g}]"),
    )
    # --warmup above --max-steps is allowed: the run only warms up (nothing non-finite), and a
    # shared flag set with a short --max-steps override (the tests' quick runs) does exactly that
    warmup: int = OPTIMIZER(20, "steps of linear warm-up to --lr", at_least(0))
    max_steps: int = OPTIMIZER(600, "optimizer steps; the cosine decay ends here", at_least(1))
    weight_decay: float = OPTIMIZER(0.1, "AdamW weight decay (not on biases, norms)", at_least(0))
    optimizer: str = OPTIMIZER(
        "adamw",
        "adamw, muon: the blocks' matrices by Muon (nanomega/muon.py), the rest by AdamW, or "
        "onebit: 1-bit Adam, the momentum all-reduced as signs after --onebit-warmup steps "
        "(nanomega/onebit.py; --zero 0)",
        choices=["adamw", "muon", "onebit"],
    )
    onebit_warmup: int = OPTIMIZER(
        100, "--optimizer onebit: uncompressed AdamW steps before the variance freezes", at_least(1)
    )
    grad_clip: float = OPTIMIZER(1.0, "clip the global gradient norm (0: off)", at_least(0))
    post_validate: bool = OPTIMIZER(
        False,
        "pipeline: step at once, validate the global norm and loss after, roll back and redo when "
        "a clip or skip was needed (ZB-H2's post-validation: nanomega/post_validate.py)",
    )
    seed: int = OPTIMIZER(
        1337,
        "the model's init and the data order",
        (lambda v, c: 0 <= v < MAX_SEED, "in [0, 2**62)"),
    )

    # the layout: world = tp x pp x cp x dp; ZeRO and offload over dp
    tp: int = PARALLEL(1, "tensor-parallel size", at_least(1))
    pp: int = PARALLEL(1, "pipeline-parallel size (dp = world / (tp x pp))", at_least(1))
    ep: int = PARALLEL(1, "expert-parallel size, carved out of dp (experts spread)", at_least(1))
    sequence_parallel: bool = PARALLEL(False, "shard LayerNorm/dropout activations over tp")
    cp: int = PARALLEL(
        1,
        "context-parallel size: each sequence split over cp ranks, attention included "
        "(nanomega/cp.py; dp = world / (tp x pp x cp))",
        at_least(1),
    )
    cp_method: str = PARALLEL(
        "ring",
        "ring (K/V passed rank to rank), allgather (Llama 3's) or ulysses (all-to-all to head "
        "shards: cp must divide the heads per tp rank)",
    )
    schedule: str = PARALLEL(
        "1f1b",
        "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v or dualpipev (zero bubble: the backward "
        "split, wgrad.py; zb-h2: 2p - 1 micro-batches in flight; zb-v, dualpipev: two chunks per "
        "rank in a V; dualpipev: m >= 2 pp)",
    )
    virtual_stages: int = PARALLEL(
        1, "model chunks per rank (interleaved, zb-v, dualpipev)"
    )  # pp.check_args
    zero: int = PARALLEL(0, "ZeRO stage 0-3 (0: plain data parallelism)")  # zero.check_config
    dp_shard: int = PARALLEL(
        0,
        "hybrid sharding (--zero 1-3): ZeRO shards over groups of this many neighbouring dp ranks "
        "(inside a host), replicated dp / dp-shard times across (0: all of dp)",
        at_least(0),
    )  # divides dp: zero_rules.hybrid_error
    zeropp_qwz: int = PARALLEL(
        0,
        "ZeRO++ qwZ (--zero 3): the weights' all-gather as blockwise int8 or int4 codes + scales "
        "(8 or 4; 0: off; nanomega/zeropp.py)",
        (lambda v, c: v in (0, 4, 8), "0, 4 or 8 (bits)"),
    )
    zeropp_hpz: bool = PARALLEL(
        False,
        "ZeRO++ hpZ (--zero 3 --dp-shard S): a copy of the gathered weights sharded inside each "
        "host of S ranks, so the backward all-gather stays inside (ZeRO-3 shards over all of dp)",
    )
    zeropp_qgz: int = PARALLEL(
        0,
        "ZeRO++ qgZ (--zero 3 --dp-shard S): the gradients' reduce-scatter as two all-to-alls of "
        "blockwise int8 or int4 codes, inside the host then across (8 or 4; 0: off)",
        (lambda v, c: v in (0, 4, 8), "0, 4 or 8 (bits)"),
    )  # what does not compose: zeropp.error
    offload: float = PARALLEL(
        0.0,
        "ZeRO-Offload (--zero 1-3): the share (0-1) of the fp32 masters and Adam state kept in "
        "host memory, stepped by the CPU Adam (nanomega/offload.py)",
        (lambda v, c: 0 <= v <= 1, "in [0, 1] (a share of the optimizer state)"),
    )
    offload_params: bool = PARALLEL(
        False,
        "ZeRO-3 parameter offload (--zero 3 --offload 1): the parameter shards in host memory "
        "too, copied up at each gather (nanomega/zero3.py)",
    )
