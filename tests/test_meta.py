"""Build any size (nanomega/meta.py): every rank draws only its own values, and they are the dense
model's, sliced, bitwise; one rank of a 175B layout builds on the meta device in seconds; the
planner's bytes are the engine's.

No process group is needed: building a rank communicates nothing, so meta.PaperGrid stands for rank
R of any layout (device="cpu" to draw its values, "meta" for a dry run)."""

import resource

import pytest
import torch

from nanomega import compose, dist, meta, pp, tp, train, zero
from nanomega.gpt_config import GPTConfig
from nanomega.initialization import INIT_BLOCK, draw
from nanomega.model import GPT
from nanomega.job import checks, flags
from nanomega.job.presets import PRESETS
from test_layouts import COMMON, LAYOUTS_4, LAYOUTS_8


def test_segments_are_the_tensor_parallel_slice():
    """The runs of the dense flat index are exactly what tp.shard_param slices, for every rule and
    rank."""
    h = 8
    shapes = {
        "wte.weight": (64, h),
        "c_attn.weight": (3 * h, h),
        "c_attn.bias": (3 * h,),
        "c_fc.weight": (4 * h, h),
        "fc_bias": (4 * h,),
        "c_proj.weight": (h, 4 * h),
        "ln_1.weight": (h,),
        "q_proj.weight": (h, h),
        "kv_proj.weight": (h, h),
        "gate_up.weight": (4 * h, h),
    }
    for name, shape in shapes.items():
        index = torch.arange(torch.Size(shape).numel()).view(shape)
        for size in (1, 2, 4):
            for rank in range(size):
                want = tp.shard_param(name, index, rank, size).reshape(-1)
                runs = meta.segments(shape, tp.shard_rule(name), rank, size)
                got = torch.cat([torch.arange(start, start + n) for start, n in runs])
                assert torch.equal(got, want), (name, size, rank)


def test_an_element_depends_on_seed_name_and_index_only():
    n = 2 * INIT_BLOCK + 123
    whole = draw(7, "blocks.0.mlp.c_fc.weight", 0.02, 0, n)
    assert torch.equal(
        torch.cat(
            [
                draw(7, "blocks.0.mlp.c_fc.weight", 0.02, a, b)
                for a, b in ((0, 5), (5, INIT_BLOCK + 1), (INIT_BLOCK + 1, n))
            ]
        ),
        whole,
    )
    # a larger tensor: same rows
    assert torch.equal(draw(7, "blocks.0.mlp.c_fc.weight", 0.02, 0, 100), whole[:100])
    # another seed
    assert not torch.equal(draw(8, "blocks.0.mlp.c_fc.weight", 0.02, 0, 100), whole[:100])
    # another parameter
    assert not torch.equal(draw(7, "blocks.1.mlp.c_fc.weight", 0.02, 0, 100), whole[:100])
    assert whole.std().item() == pytest.approx(0.02, rel=0.01)
    assert torch.equal(draw(7, "x", None, 3, 9), torch.ones(6)) and torch.equal(
        draw(7, "x", 0.0, 0, 4), torch.zeros(4)
    )


def test_the_dense_model_is_its_seed():
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    a, b = GPT(cfg, seed=3), GPT(cfg, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(GPT(cfg, seed=4).embed.wte.weight, a.embed.wte.weight)
    torch.manual_seed(5)
    # no seed: one drawn from torch's generator, as nanoGPT's GPT(config) after torch.manual_seed
    c = GPT(cfg)
    torch.manual_seed(5)
    assert torch.equal(GPT(cfg).embed.wte.weight, c.embed.wte.weight)
    blocks = a.blocks["1"]
    assert torch.equal(blocks.ln_1.weight, torch.ones(32)) and torch.equal(
        blocks.attn.c_attn.bias, torch.zeros(96)
    )


def config_of(extra, world, rank=0):
    return checks.check(
        flags.parse([*COMMON, *extra, "--dry-run", "--world", str(world), "--rank", str(rank)])
    )


def expected_local(dense, name, p, grid):
    """The dense parameter's slice that this rank's parameter `name` must equal."""
    full = dense[pp.saved_name(name, p)]
    return (
        tp.shard_param(pp.saved_name(name, p), full, grid.tp_rank, grid.tp.size)
        if tp.is_tensor_parallel(p)
        else full
    )


LAYOUTS = [
    ("tp2", ["--tp", "2"], 2),
    ("pp2", ["--pp", "2", "--grad-accum", "2"], 2),
    ("tp2-pp2", ["--tp", "2", "--pp", "2", "--grad-accum", "2"], 4),
    ("zero3-dp2", ["--zero", "3"], 2),
    *[(name, extra, 4) for name, extra in LAYOUTS_4],
    *[(name, extra, 8) for name, extra in LAYOUTS_8],
]
# the Llama block (4 query heads, 2 key/value heads, an untied head): split k/v at tp2, held whole
# at tp4
LLAMA = ["--arch", "llama", "--n-kv-head", "2", "--ffn-hidden", "64", "--untie-embeddings"]
LAYOUTS += [
    (f"llama-{name}", [*LLAMA, *extra], world)
    for name, extra, world in (
        ("tp2-pp2", ["--tp", "2", "--pp", "2", "--grad-accum", "2"], 4),
        ("tp4-sp", ["--tp", "4", "--sequence-parallel"], 4),
        ("tp2-dp2-zero3", ["--tp", "2", "--zero", "3"], 4),
    )
]


@pytest.mark.parametrize("name,extra,world", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_every_rank_draws_the_slice_of_the_dense_model(name, extra, world, monkeypatch):
    """Each rank built (compose.build, meta device -> this rank's values drawn into the engine's
    buffers) holds, bitwise, the dense model's slice: tensor-parallel slices of its stage's
    parameters, or at ZeRO-3 the flat shard of them. A wrong run, rank or seed changes whole rows:
    torch.equal fails. Each rank is built alone, so the engine's replica check (one all-gather over
    dp; lesson 15 counts it) is left out here."""
    monkeypatch.setattr(zero, "start_equal", lambda *args: None)
    for rank in range(world):
        config = config_of(extra, world, rank)
        cfg = flags.model_config(config)
        dense = dict(GPT(cfg, seed=config.seed).named_parameters())
        grid = meta.PaperGrid(config.dp, config.pp, config.tp, rank, device="cpu")
        model, engine, _ = compose.build(config, grid)
        if engine.sharded is None:
            names = [n for n, _ in model.named_parameters()]
            for n, p in model.named_parameters():
                assert torch.equal(p, expected_local(dense, n, p, grid)), (name, rank, n)
            layers = {n.split(".")[1] for n in names if n.startswith("blocks.")}
            want = {
                str(i)
                for c in range(config.virtual_stages)
                for i in pp.chunk_layers(
                    cfg.n_layer, config.pp, grid.pp_rank, c, config.virtual_stages
                )
            }
            assert layers == want  # the stage's layers, no more
        else:  # ZeRO-3: only the shards exist (the parameters are empty between uses)
            for g in engine.sharded.groups:
                full = torch.cat(
                    [
                        expected_local(dense, n, p, grid).detach().reshape(-1)
                        for n, p in zip(g.names, g.params)
                    ]
                )
                assert g.shard.numel() == g.shard_numel and g.full.untyped_storage().nbytes() == 0
                assert torch.equal(
                    g.shard[: max(0, min(g.numel - g.lo, g.shard_numel))],
                    full[g.lo : min(g.hi, g.numel)],
                ), (name, rank, g.names)


def test_materialize_a_tensor_parallel_model_without_the_engine():
    cfg = GPTConfig(
        vocab_size=200,
        block_size=16,
        n_layer=2,
        n_head=4,
        n_embd=32,
        alibi=True,
        make_vocab_size_divisible_by=256,
    )
    dense = dict(GPT(cfg, seed=11).named_parameters())
    for rank in range(2):
        grid = meta.PaperGrid(1, 1, 2, rank, device="cpu")
        with torch.device("meta"):
            model = GPT(cfg, seed=11)
        tp.apply_tensor_parallel(model, grid.tp, sequence_parallel=True)
        meta.materialize(model, meta.Init(cfg, 11, rank, 2), "cpu")
        for n, p in model.named_parameters():
            assert not p.is_meta and torch.equal(p, expected_local(dense, n, p, grid)), n
        assert torch.equal(
            model.blocks["0"].attn.slopes, GPT(cfg).blocks["0"].attn.slopes.chunk(2)[rank]
        )


def dry_run(argv):
    return train.main([*argv, "--dry-run"])


def assert_planner_is_engine(res):
    """Engine bytes = planner bytes, up to what the planner does not model: each flat group's
    padding to a multiple of dp (< dp elements: 2-4 bytes each for parameters, 4 for gradients, 12
    for masters and Adam) and Adam's 4-byte step counter per piece. A layer or an embedding off is
    megabytes: this fails."""
    engine, plan, slack = res["engine"], res["planner"], res["groups"] * res["dp"]
    assert abs(engine["params"] - plan["params"]) <= 4 * slack
    assert abs(engine["grads"] - plan["grads"]) <= 4 * slack
    assert abs(engine["optimizer"] - 4 * res["pieces"] - plan["optimizer"]) <= 12 * slack
    assert plan["params"] > 0 and plan["optimizer"] > 0


def test_gpt3_175b_rank_builds_on_meta_in_seconds():
    base = [
        "--model",
        "gpt3-175b",
        "--tp",
        "8",
        "--pp",
        "16",
        "--world",
        "1024",
        "--zero",
        "1",
        "--dtype",
        "bf16",
    ]
    for rank in (0, 1023):
        res = dry_run([*base, "--rank", str(rank)])
        assert res["seconds"] < 30
        assert_planner_is_engine(res)
        # 1.46B bf16 parameters on this GPU
        assert res["engine"]["params"] == pytest.approx(2.9e9, rel=0.02)


# published layouts the planner reproduces (lessons/21_plan.py): preset, tp, pp, GPUs, ZeRO stage,
# dtype
PUBLISHED = [
    ("gpt3-175b", 8, 16, 1024, 1, "bf16"),
    ("bloom-176b", 4, 12, 384, 1, "bf16"),
    ("megatron-1.7b", 1, 1, 32, 0, "fp16"),
    ("megatron-3.6b", 2, 1, 64, 0, "fp16"),
    ("megatron-7.5b", 4, 1, 128, 0, "fp16"),
    ("megatron-18.4b", 8, 1, 256, 0, "fp16"),
    ("megatron-39.1b", 8, 2, 512, 0, "fp16"),
    ("megatron-76.1b", 8, 4, 1024, 0, "fp16"),
    ("megatron-145.6b", 8, 8, 1536, 0, "fp16"),
    ("megatron-310.1b", 8, 16, 1920, 0, "fp16"),
    ("megatron-529.6b", 8, 35, 2520, 0, "fp16"),
    ("megatron-1t", 8, 64, 3072, 0, "fp16"),
    ("llama3-405b", 8, 16, 8192, 1, "bf16"),
]  # Llama 3 Table 4 row 1: TP8 PP16 DP64
# every other preset: the largest tp of 8, 4, 2, 1 its heads allow, 2 stages and 2 replicas with
# ZeRO-1; and the gpt3 family at ZeRO-3 (no pipeline: the rule of zero_rules.pipeline_error)
OTHERS = [
    (name, max(t for t in (1, 2, 4, 8) if PRESETS[name]["n_head"] % t == 0), 2, 0, 1, "bf16")
    for name in PRESETS
    # deepseek-v3: at its published PP16 x EP64 layout (tests/test_moe_dense.py), not all experts
    if name not in {row[0] for row in PUBLISHED} | {"deepseek-v3"}
]
OTHERS = [(name, t, p, t * p * 2, z, dtype) for name, t, p, _, z, dtype in OTHERS] + [
    ("gpt3-13b", 8, 1, 32, 3, "bf16"),
    ("gpt3-1.3b", 2, 1, 8, 3, "fp32"),
]


@pytest.mark.parametrize(
    "model,tp_,pp_,gpus,zero,dtype",
    PUBLISHED + OTHERS,
    ids=[f"{r[0]}-tp{r[1]}-pp{r[2]}-{r[3]}-zero{r[4]}" for r in PUBLISHED + OTHERS],
)
def test_planner_bytes_are_the_engine_bytes_of_the_first_and_last_rank(
    model, tp_, pp_, gpus, zero, dtype
):
    base = [
        "--model",
        model,
        "--tp",
        str(tp_),
        "--pp",
        str(pp_),
        "--world",
        str(gpus),
        "--zero",
        str(zero),
        "--dtype",
        dtype,
        "--grad-accum",
        str(pp_),
    ]
    for rank in (0, gpus - 1):
        assert_planner_is_engine(dry_run([*base, "--rank", str(rank)]))


def test_planner_counts_the_experts_one_ep_rank_holds():
    """Mixtral 8x7B at ep 4 (tools/cost_moe.py): each rank holds 2 of the 8 experts of its layers,
    their ZeRO-1 state sharded over edp = dp / ep; the dense part over dp. ep 1 (every expert
    everywhere): OTHERS' row."""
    base = [
        "--model",
        "mixtral-8x7b",
        "--tp",
        "2",
        "--pp",
        "2",
        "--world",
        "32",
        "--zero",
        "1",
        "--ep",
        "4",
        "--dtype",
        "bf16",
        "--grad-accum",
        "2",
    ]
    for rank in (0, 31):
        res = dry_run([*base, "--rank", str(rank)])
        assert_planner_is_engine(res)
        assert res["engine"]["params"] < 7e9  # a quarter of the experts: 23.4 GB at ep 1


def test_a_dry_run_allocates_nothing_and_a_paper_grid_refuses_collectives():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)
    res = dry_run(
        ["--model", "megatron-1t", "--tp", "8", "--pp", "64", "--world", "3072", "--dtype", "bf16"]
    )
    assert sum(res["engine"].values()) > 30e9  # 38 GB counted on meta: more than this machine has
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak < 0.5e9
    grid = meta.PaperGrid(2, 1, 1, 1)
    with pytest.raises(RuntimeError, match="dry run has no process group"):
        grid.dp.all_reduce(torch.zeros(1))
    with pytest.raises(ValueError, match="--rank 4 is outside the 4 ranks"):
        meta.PaperGrid(2, 1, 2, 4)
    with pytest.raises(ValueError, match="--rank and --world are for --dry-run"):
        checks.check(flags.parse(["--rank", "3"]))


@pytest.mark.parametrize("dp,pp,tp,cp,ep", [(4, 2, 2, 1, 2), (2, 3, 2, 2, 1), (6, 2, 1, 2, 3)])
def test_a_paper_grid_finds_its_own_groups_as_the_whole_layout_lists_them(dp, pp, tp, cp, ep):
    """Issue 43: dist.layout(..., rank) lists only that rank's groups (a dry run of a million ranks
    in seconds): for every rank, the groups holding it are the whole layout's."""
    whole = dist.layout(dp, pp, tp, cp, ep)
    for rank in range(dp * pp * tp * cp):
        mine = dist.layout(dp, pp, tp, cp, ep, rank)
        for axis, groups in whole.items():
            want = [g.tolist() for g in groups if rank in g.tolist()]
            assert [g.tolist() for g in mine[axis] if rank in g.tolist()] == want, (axis, rank)
