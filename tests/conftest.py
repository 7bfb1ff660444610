import gzip
import importlib.metadata
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def one_thread():
    """One OpenMP thread for a module's in-process training: with other processes on the 2 cores, 2
    threads spin-wait and run ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(request, tmp_path_factory):
    """A small.txt of the embedded corpus's first CORPUS_CHARS characters (a module may set
    CORPUS_CHARS; 300,000 by default: enough windows for a few steps, tokenized in a moment), one
    per test module."""
    chars = getattr(request.module, "CORPUS_CHARS", 300_000)
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(chars))
    return path


@pytest.fixture(scope="module")
def grid():
    """A world of one in this process (gloo on a HashStore); torn down if this module started it."""
    from nanomega import dist

    started = not torch.distributed.is_initialized()
    dist.init("cpu")
    yield dist.Grid(1, 1, 1)
    if started:
        torch.distributed.destroy_process_group()


# The quick tier, `python -m pytest -m quick` (README: about 2 minutes on 2 cores with the build
# cache warm): every technique once, for the inner loop; the whole suite stays the gate. Node-id
# prefixes; a prefix that selects nothing in a collected module is an error (a renamed test must be
# renamed here too).
QUICK = {
    "the grid, layouts": "tests/test_dist.py::test_layout_partitions_the_world",
    "the dense GPT and Llama": "tests/test_model.py",
    "data, resumable": "tests/test_data.py::test_resume_continues_the_uninterrupted_stream",
    "flags and ranges": "tests/test_args.py",
    "DP and ZeRO 0-3 == one process": "tests/test_zero.py::test_two_ranks_equal_single_process_bitwise[gpt-",
    "checkpoint, reshard by name": "tests/test_zero.py::test_save_load_continue_and_reshard_by_name[gpt-",
    "TP and SP == dense, bytes": "tests/test_tp.py::test_layers_match_dense",
    "pipeline schedules": "tests/test_pp.py::test_op_orders_literal",
    "pipeline == dense": "tests/test_pp.py::test_pipeline_equals_dense",
    "zero-bubble schedules": "tests/test_zero_bubble.py::test_zb_h1_bubble_and_memory_equal_the_formulas",
    "ZB-V on the V": "tests/test_zb_v.py::test_zb_v_bubble_and_memory_equal_the_formulas",
    "DualPipeV": "tests/test_dualpipe.py::test_dualpipev_bubble_and_memory_equal_the_formulas",
    "DualPipeV's MoE overlap order": "tests/test_dualpipe.py::test_pair_hands_the_turn_at_each_all_to_all",
    "ZB-H2's parallelogram": "tests/test_zero_bubble.py::test_zb_h2_bubble_and_memory_equal_the_formulas[times0]",
    "mixed precision": "tests/test_precision.py::test_matmuls_in_half_softmax_and_loss_in_fp32",
    "recompute": "tests/test_recompute.py::test_every_mode_is_bitwise_no_recompute",
    "fused kernels": "tests/test_fused.py::test_gpt_with_fused_matches_gpt",
    "CPU Adam": "tests/test_cpu_adam.py::test_kernel_equals_reference_bitwise",
    "offload": "tests/test_offload.py::test_offload_equals_the_engine_without_it_bitwise[2-",
    "meta-device build": "tests/test_meta.py::test_every_rank_draws_the_slice_of_the_dense_model",
    "flash restore": "tests/test_flash.py::test_intact_copy_is_read_a_damaged_one_falls_back",
    "faults": "tests/test_faults.py::test_nan_step_is_skipped_or_stops",
    "experts and EP == one process": "tests/test_moe.py::test_losses_and_norms_match_single_process",
    "HF interchange": "tests/test_moe.py::test_mixtral_round_trip_logits",
    "routers == transformers": "tests/test_routers.py::test_each_router_is_its_models_and_no_other",
    "context parallel == full attention": "tests/test_cp.py::test_attention_equals_full_attention[op-(2, 'ring')]",
    "document masks": "tests/test_documents.py",
    "the planner": "tests/test_plan.py::test_cli_plans_llama3_405b",
    "the planner on published rows": "tests/test_published.py::test_calibration_rows",
    "Muon": "tests/test_muon.py::test_one_process_step_equals_a_plain_reimplementation",
    "1-bit Adam's compressor": "tests/test_onebit.py::test_compressor_equals_an_independent_reference",
    "HF import, checked": "tests/test_hf_inputs.py::test_transformers_load_report_is_refused_by_name",
    "Qwen2/Qwen3, RoPE rules": "tests/test_hf_qwen.py::test_qwen_logits_both_ways[qwen3]",
    "DCP, torchtitan's names": "tests/test_dcp.py::test_interleaved_rows_are_metas_rotary",
    "TensorBoard": "tests/test_tensorboard.py",
    "the training loop": "tests/test_train.py::test_resume_without_checkpoint_starts_fresh",
    "the layout fuzzer knows every flag": "tests/test_fuzz.py::test_every_flag_is_drawn_or_excused",
    "house rules": "tests/test_house.py",
    "lessons' references": "tests/test_lessons.py::test_references_resolve",
    "the exercise grader": "tests/test_exercises.py::test_a_file_without_the_names_is_one_line",
    "FP8 casts against the bit-level reference": "tests/test_fp8.py::test_quantize_tiles",
    "the FP8 linear's GEMMs": "tests/test_fp8_train.py::test_gemms_are_the_recipes_arithmetic",
    "ZeRO-3's FP8 gather bytes (dry run)": "tests/test_fp8.py::test_dry_run_shows_the_fp8_gather_bytes",
    "the planner's FP8 peak (dry run, plan --fp8)": "tests/test_fp8.py::"
    "test_planner_prices_the_fp8_gemms_at_the_datasheet_peak",
    "MLA against transformers": "tests/test_mla.py::test_mla_is_transformers_deepseek_v3_attention",
    "MTP over the whole step's targets": "tests/test_mtp.py::test_micro_batches_and_ranks_count_the_whole_step",
    "DeepSeek-V3 in and out": "tests/test_hf_deepseek.py::test_deepseek_v3_round_trip_logits[moe]",
    "dense blocks before MoE ones": "tests/test_moe_dense.py::test_dense_blocks_before_moe_ones",
    "hybrid sharding's links (dry run)": "tests/test_hybrid.py::test_dry_run_prices_the_links_refuses_bad_shards",
    "ZeRO++ quantizer": "tests/test_zeropp.py::test_quantizer_equals_the_reference",
    "the planner on two links (dry run)": "tests/test_cost_link.py::test_prediction_bytes_are_the_dry_runs",
}


def _selects(prefix, nodeid):
    """A QUICK prefix names a module, a test (every parametrization), one test id, or (ending in `[`
    or `-`) some of a test's parametrizations."""
    if prefix.endswith(("[", "-")):
        return nodeid.startswith(prefix)
    return nodeid == prefix or nodeid.startswith(prefix + ("[" if "::" in prefix else "::"))


# before -m / -k deselect: QUICK is held against every collected test
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark QUICK's tests `quick`; a QUICK prefix whose module was collected whole but which selects
    nothing is an error (not checked when node ids were asked for: the rest of their modules was not
    collected)."""
    matched = set()
    for item in items:
        for prefix in QUICK.values():
            if _selects(prefix, item.nodeid):
                item.add_marker(pytest.mark.quick)
                matched.add(prefix)
    if any("::" in arg for arg in config.args):
        return
    collected = {item.nodeid.split("::")[0] for item in items}
    stale = [p for p in QUICK.values() if p.split("::")[0] in collected and p not in matched]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that do not exist: {stale}")


def pytest_configure(config):
    """The CPU suite runs on the CPU on any machine: on a GPU host `--device auto` would pick CUDA,
    and two ranks on one GPU fail ("LOCAL_RANK 1 but this node sees 1 CUDA device"). train.py's
    default device comes from $NANOMEGA_DEVICE, inherited by every subprocess and torchrun job of
    the tests; the GPU tier (-m gpu) sets its device itself (tests/test_gpu.py)."""
    if "gpu" not in (config.option.markexpr or ""):
        os.environ.setdefault("NANOMEGA_DEVICE", "cpu")


VERSIONS = ("torch", "numpy", "tiktoken", "pytest", "transformers")  # what a fresh install resolved


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def pytest_sessionstart(session):
    """The CPU the suite runs on, printed first even under -q: tolerances are derived
    (tests/tolerance.py), but a failure report should still say which vector ISA and kernels
    produced it (ATEN_CPU_CAPABILITY and NANOMEGA_MARCH make this CPU take another's code paths)."""
    from nanomega import extension

    forced = {
        k: os.environ[k]
        for k in (
            "ATEN_CPU_CAPABILITY",
            "NANOMEGA_MARCH",
            "MKL_ENABLE_INSTRUCTIONS",
            "ONEDNN_MAX_CPU_ISA",
            "OMP_NUM_THREADS",
        )
        if k in os.environ
    }
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"cpu: {extension.cpu_summary()}; {torch.get_num_threads()} threads; "
            f"emulating: {forced or 'nothing (native)'}"
        )
        reporter.write_line(
            "versions: " + ", ".join(f"{name} {_version(name)}" for name in VERSIONS)
        )


# Where the suite's time goes, by file: with --durations (CI sets --durations=40), the files whose
# tests took longest, setup and teardown included (a module's spawned world is its first test's
# setup), printed after pytest's per-test list
_FILE_SECONDS = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    if config.option.durations is None or not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest files ({total:.0f} s in all)")
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    for path, seconds in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
