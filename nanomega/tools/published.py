"""Published runs the planner predicts: which rows fitted its constants, and which it never saw.

Idea: a model is judged on rows it was not fitted on. Each row is one published run: its layout,
the figure it reports (hardware TFLOP/s per GPU, MFU, or tokens/s per GPU), its source, and its
role: "calibration" (cost_time.TimeModel's constants were chosen on it) or "out-of-sample" (never
used to choose anything). A row that is ever used to refit moves to calibration. The planner's
prediction is shown twice: with overlap "none" (Megatron-LM 2021's sum) and with the run's own
overlap (tools/overlap.py), and its error
    error = prediction / published - 1
MISSES lists, with the reason, every out-of-sample row outside +-BAND; tests/test_published.py
checks that exactly those are outside.
    python -m nanomega.tools.published        the table (markdown, as lesson 21 and bench/RESULTS.md)
Lesson: lessons/21-planning-a-run.md
"""

from dataclasses import dataclass, replace

from nanomega.tools import cost_time, cp_cost
from nanomega.tools.cost import GPUS, MODELS, Model, Run

BAND = 0.10  # the goal for out-of-sample rows: within +-10% of the published figure

MEGATRON_2021 = "Narayanan et al. 2021, Table 1 (A100, fp16, full recompute)"
BIGSCIENCE = "BigScience BLOOM-176B, tr11-176B-ml README (Jean Zay, 150 TFLOP/s)"
META = "Grattafiori et al. 2024 (Llama 3), Table 4"
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MCORE = "Megatron-LM README, images/model_table.png (Megatron-Core r0.8.0, H100)"


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: Model
    gpu: str  # a CLUSTERS key: tools/cost.GPUS and BLOOM's
    gpus: int
    tp: int
    pp: int
    zero: int
    run: Run
    metric: str  # "tflops": hardware TFLOP/s per GPU (counting recompute); "mfu"; "tokens": /s/GPU
    published: float
    role: str  # "calibration" | "out-of-sample"
    cp: int = 1
    note: str = ""

    def layout(self):
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        v = f" v{self.run.chunks}" if self.run.schedule == "interleaved" else ""
        return f"tp{self.tp}{cp} pp{self.pp}{v} dp{self.gpus // (self.tp * self.pp * self.cp)} z{self.zero}"


def estimate(row, plain=False):
    """The planner's Estimate of the row's layout: with the run's own overlap, or (plain) none at
    all, neither dp's nor tp's: the sum TimeModel was fitted with."""
    run = replace(row.run, overlap="none", tp_overlap=False) if plain else row.run
    args = (row.model, CLUSTERS[row.gpu], row.gpus, row.tp, row.pp)
    if row.cp > 1:
        return cp_cost.evaluate(*args, row.cp, row.zero, run, "allgather")[0]
    return cost_time.evaluate(*args, row.zero, run)


def predict(row, plain=False):
    """The row's figure as the planner predicts it (plain: without overlap)."""
    e = estimate(row, plain)
    if row.metric == "tflops":
        return e.tflops / 1e12
    if row.metric == "mfu":
        return e.mfu
    return row.run.global_batch * row.model.seq_len / (e.step_s * row.gpus)


# ---- the rows
# -------------------------------------------------------------------------------------
MEGATRON = Run(micro_batch=1, dtype="fp16", recompute="full", sp=False, zero=(0,))
TABLE_1 = [  # preset, tp, pp, GPUs, global batch, TFLOP/s per GPU
    ("megatron-1.7b", 1, 1, 32, 512, 137),
    ("megatron-3.6b", 2, 1, 64, 512, 138),
    ("megatron-7.5b", 4, 1, 128, 512, 142),
    ("megatron-18.4b", 8, 1, 256, 1024, 135),
    ("megatron-39.1b", 8, 2, 512, 1536, 138),
    ("megatron-76.1b", 8, 4, 1024, 1792, 140),
    ("megatron-145.6b", 8, 8, 1536, 2304, 148),
    ("megatron-310.1b", 8, 16, 1920, 2160, 155),
    ("megatron-529.6b", 8, 35, 2520, 2520, 163),
    ("megatron-1t", 8, 64, 3072, 3072, 163),
]
# the GPU presets and BLOOM's cluster, Jean Zay: 4 x 100 Gb/s Omni-Path per 8-GPU node = 6.25 GB/s
CLUSTERS = {**GPUS, "a100-jean-zay": replace(GPUS["a100-80gb"], inter_bw=6.25e9)}
BLOOM = Run(global_batch=2048, micro_batch=2, dtype="bf16", recompute="full", sp=False, zero=(1,))
# Llama 3 405B: seq 8192, 16M tokens per batch, no recompute (FlashAttention), 8 chunks per rank on
# Llama 3's split; FSDP (gradients and optimizer sharded) priced as ZeRO-1's bytes, overlapped
LLAMA3 = Run(
    global_batch=2048, micro_batch=1, recompute="none", zero=(1,), attention="sdpa",
    schedule="interleaved", chunks=8, split="llama3", overlap="overlap",
)  # fmt: skip
# torchtitan: Llama 3.1 at seq 8192 (its llama3 configs), FSDP2 = ZeRO-3 per micro-batch, bf16
TITAN_8B = Run(global_batch=16, micro_batch=2, recompute="selective", zero=(3,), attention="sdpa",
               overlap="overlap")  # fmt: skip
FLOAT8 = "Float8 + torch.compile: the planner prices bf16"
# its 405B pipelines: pp micro-batches per step (torchtitan's default at the benchmark's commit,
# experimental.pipeline_parallel_microbatches = pp degree): 32 sequences per dp rank as 8 x 4
# Megatron-Core r0.8.0: GPT blocks (12h^2), untied 131,072 vocabulary, seq 4096, bf16, distributed
# optimizer, SP, TE attention, dp/tp/pp overlap on; micro-batch 1 and no recompute assumed
MCORE_RUN = Run(micro_batch=1, recompute="none", zero=(1,), attention="sdpa", overlap="overlap",
                tp_overlap=True)  # fmt: skip
MCORE_ROWS = [  # (heads, hidden, layers, tp, pp, GPUs, batch, MFU)
    (16, 2048, 24, 1, 1, 48, 192, 0.41),
    (32, 4096, 30, 2, 1, 96, 192, 0.47),
    (48, 6144, 32, 4, 1, 192, 192, 0.49),
    (56, 7168, 48, 8, 1, 384, 192, 0.46),
    (64, 8192, 84, 8, 2, 768, 384, 0.42),
    (80, 10240, 92, 8, 4, 1536, 768, 0.43),
    (96, 12288, 96, 8, 6, 2304, 1152, 0.44),
    (128, 16384, 96, 8, 8, 3072, 1536, 0.48),
    (144, 18432, 112, 8, 16, 6144, 3072, 0.47),
]


def rows():
    """Every published row, in the table's order."""
    out = [
        Row(
            f"Megatron 2021 T1 row {i + 1} ({name[9:]})",
            MEGATRON_2021,
            MODELS[name],
            "a100-80gb",
            gpus,
            tp,
            pp,
            0,
            replace(MEGATRON, global_batch=batch),
            "tflops",
            tf,
            ("calibration", "out-of-sample")[i % 2],
            note="" if i % 2 else "fitted TimeModel (matmul, elem, score)",
        )  # fmt: skip
        for i, (name, tp, pp, gpus, batch, tf) in enumerate(TABLE_1)
    ]
    out.append(
        Row(
            "BLOOM-176B",
            BIGSCIENCE,
            MODELS["bloom-176b"],
            "a100-jean-zay",
            384,
            4,
            12,
            1,
            BLOOM,
            "tflops",
            150,
            "calibration",
            note="fitted TimeModel with the Table 1 rows",
        )  # fmt: skip
    )
    llama = MODELS["llama3-405b"]
    out += [
        Row(
            f"Llama 3 405B, {g} GPUs",
            META,
            llama,
            "h100-80gb",
            g,
            8,
            16,
            1,
            LLAMA3,
            "tflops",
            tf,
            "out-of-sample",
        )  # fmt: skip
        for g, tf in ((8192, 430), (16384, 400))
    ]
    out.append(
        Row(
            "Llama 3 405B, 131K tokens, CP16",
            META,
            replace(llama, seq_len=131072),
            "h100-80gb",
            16384,
            8,
            16,
            1,
            replace(LLAMA3, global_batch=128),
            "tflops",
            380,
            "out-of-sample",
            cp=16,
            note="CP all-gather priced exposed",
        )  # fmt: skip
    )
    l8, l70, l405 = (MODELS[f"llama3-{n}"] for n in ("8b", "70b", "405b"))
    full = replace(TITAN_8B, recompute="full")
    out += [
        Row("torchtitan 8B FSDP, 8 GPUs (T1)", TITAN, l8, "h100-96gb", 8, 1, 1, 3, TITAN_8B,
            "tokens", 5762, "out-of-sample"),
        Row("torchtitan 8B FSDP, 128 GPUs (T3)", TITAN, l8, "h100-96gb", 128, 1, 1, 3,
            replace(TITAN_8B, global_batch=256), "tokens", 5605, "out-of-sample"),
        Row("torchtitan 70B FSDP32 x TP8 (T4)", TITAN, l70, "h100-96gb", 256, 8, 1, 3,
            replace(full, global_batch=512, micro_batch=16), "tokens", 829, "out-of-sample",
            note=FLOAT8 + " (no async TP)"),
        Row("torchtitan 405B 1F1B (T5)", TITAN, l405, "h100-96gb", 512, 8, 8, 1,
            replace(full, global_batch=256, micro_batch=4, zero=(1,), tp_overlap=True), "tokens", 100,
            "out-of-sample", note=FLOAT8),
        Row("torchtitan 405B interleaved (T5)", TITAN, l405, "h100-96gb", 512, 8, 8, 1,
            replace(full, global_batch=256, micro_batch=4, zero=(1,), schedule="interleaved",
                    tp_overlap=True),
            "tokens", 128, "out-of-sample", note=FLOAT8),
    ]  # fmt: skip
    for a, h, L, tp, pp, g, batch, mfu in MCORE_ROWS:
        shape = Model(L, h, a, 131072, 4096, tie_embeddings=False)
        out.append(
            Row(
                f"Megatron-Core {h} x {L}",
                MCORE,
                shape,
                "h100-80gb",
                g,
                tp,
                pp,
                1,
                replace(MCORE_RUN, global_batch=batch),
                "mfu",
                mfu,
                "out-of-sample",
            )  # fmt: skip
        )
    return out


# out-of-sample rows outside +-BAND, and why (tests/test_published.py: exactly these)
SMALL_GEMMS = "one matmul efficiency (TimeModel.matmul) for every GEMM size: small ones run slower"
TITAN_H100 = (
    "500 W H100s whose peak lies between SXM's and NVL's (the file's footnote), priced at SXM's; "
    "torchtitan's op-level selective recompute reruns more than Korthikanti's"
)
MISSES = {
    "Llama 3 405B, 8192 GPUs": "FSDP priced as ZeRO-1 bytes, fully overlapped; no straggler or "
    "network-congestion term (Llama 3's paper names both)",
    "Llama 3 405B, 16384 GPUs": "as the 8,192-GPU row",
    "Llama 3 405B, 131K tokens, CP16": "the CP all-gather's exposure beyond bytes / bandwidth",
    "torchtitan 8B FSDP, 8 GPUs (T1)": TITAN_H100,
    "torchtitan 8B FSDP, 128 GPUs (T3)": TITAN_H100,
    "torchtitan 70B FSDP32 x TP8 (T4)": FLOAT8,
    "Megatron-Core 2048 x 24": SMALL_GEMMS,
    "Megatron-Core 4096 x 30": SMALL_GEMMS,
    "Megatron-Core 7168 x 48": "tp8 at h = 7168 on one node: TP overlap priced per layer, not per "
    "chunk",
}


# ---- the table
# ------------------------------------------------------------------------------------
def fmt(row, x):
    return f"{x:.1%}" if row.metric == "mfu" else f"{x:,.0f}"


def table():
    """The markdown table: one line per row, calibration first, then out-of-sample."""
    unit = {"tflops": "TFLOP/s/GPU", "mfu": "MFU", "tokens": "tokens/s/GPU"}
    lines = [
        "| run | layout | GPUs | published | no overlap | overlap | error | role | note |",
        "|---|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for role in ("calibration", "out-of-sample"):
        for r in (r for r in rows() if r.role == role):
            plain, over = predict(r, plain=True), predict(r)
            err = over / r.published - 1
            flag = " (miss)" if r.role == "out-of-sample" and abs(err) > BAND else ""
            lines.append(
                f"| {r.name} | {r.layout()} | {r.gpus:,} | {fmt(r, r.published)} {unit[r.metric]} "
                f"| {fmt(r, plain)} | {fmt(r, over)} | {err:+.1%}{flag} | {r.role} | {r.note} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
