"""The planner on two links (nanomega/tools/cost_link.py): hybrid sharding, ZeRO++ and 1-bit Adam
priced per link, and its choice between them by the inter-host rate.

Its bytes against the Axis counts of real runs live beside those runs (tests/test_zeropp.py's
test_bytes_per_link_are_the_formula, tests/test_onebit.py's test_bytes_after_the_warmup_are_the_
formula, each with a planted omission that fails); here: its bytes against --dry-run's engine on
meta, the search's choice on a slow and a fast link (derived below), and the command's line."""

import pytest

from nanomega import train
from nanomega.tools import cost_link
from nanomega.tools.cost_link import SLACK, Network, Scheme

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "64"]
RUN = [*MODEL, "--batch-size", "1", "--grad-accum", "2"]


def test_prediction_bytes_are_the_dry_runs():
    """hybrid 2 x 2 and ZeRO++ (all three) at world 4: the planner's (inside, across) = the
    engine's own, as --dry-run prints them (formulas over the padded buffers of rank 0)."""
    net = Network(host=2)
    for scheme in (Scheme(3, 2), Scheme(2, 2), Scheme(3, 2, 8, True, 8)):
        argv = [*RUN, "--world", "4", *scheme.flags()]
        dry = train.main([*argv, "--dry-run"])["links"][0]
        p = cost_link.predict([*RUN, "--world", "4"], scheme, net)
        assert (p.inside, p.across) == pytest.approx(dry, rel=1e-12), scheme


def test_a_slow_link_picks_less_across_a_fast_one_plain_zero3():
    """2 hosts x 2, ZeRO-3, compute 1 s. Fast (100 Gbit/s, 100 GB/s inside): every scheme's
    communication is under SLACK of the compute, so all tie and the least memory wins -- plain
    ZeRO-3 over all 4 (hybrid holds 2x the state, hpZ a copy; qwZ/qgZ tie its memory but round).
    Slow (10 Mbit/s): plain's 24 MB across take ~38 s; hybrid / ZeRO++ send fewer across, so the
    fastest is more than SLACK ahead of plain and is picked."""
    argv, compute = [*RUN, "--world", "4"], 1.0
    fast = Network(2, inside_bw=1e11, across_bw=1.25e10, inside_alpha=0, across_alpha=0)
    ranked, best = cost_link.search(argv, 3, fast, compute)
    assert all(p.comm_s < SLACK * compute for p in ranked)
    assert best.scheme == Scheme(3)
    assert ranked[0].scheme != Scheme(3)  # by time alone it would not be: memory decides
    ranked, best = cost_link.search(argv, 3, Network.capped(2, 10), compute)
    plain = next(p for p in ranked if p.scheme == Scheme(3))
    assert best.step_s * (1 + SLACK) < plain.step_s and best.across < plain.across
    assert best.scheme.shard == 2, best.scheme  # hybrid or ZeRO++ over hosts of 2
    print({p.scheme.name(): round(p.step_s, 2) for p in ranked})


def test_stage0_slow_link_picks_1bit_adam_a_fast_one_adamw():
    """2 hosts x 1 rank (bench/slow_link.py's layout), ZeRO-0: 1-bit Adam sends ~1/32 of AdamW's
    all-reduce after its warm-up and holds 2 error buffers more: on 10 Mbit/s it is faster by far
    more than SLACK; on 100 Gbit/s both are under SLACK of the compute, and AdamW holds less."""
    argv = [*RUN, "--world", "2"]
    _, slow = cost_link.search(argv, 0, Network.capped(1, 10), 1.0)
    fast = Network(1, across_bw=1.25e10, across_alpha=0)
    ranked, best = cost_link.search(argv, 0, fast, 1.0)
    assert slow.scheme == Scheme(0, onebit=True) and best.scheme == Scheme(0)
    assert {p.scheme for p in ranked} == {Scheme(0), Scheme(0, onebit=True)}
    memory = {p.scheme.onebit: p.memory for p in ranked}
    assert memory[True] > memory[False]


@pytest.mark.parametrize("mbit", [10, 20])
def test_the_command_prints_the_predicted_step(capsys, mbit):
    """The line beside a tc tbf measurement: bytes across / rate + compute, for one scheme."""
    cost_link.main(["--host", "1", "--across-mbit", str(mbit), "--compute-s", "2", "--", *RUN])
    cost_link.main(["--host", "1", "--across-mbit", str(mbit), "--", *RUN, "--world", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[-6:-2] == ["0.000", "0.000", "0.000", "2.000"]  # one rank: no bytes
    step = float(out[5].split()[-3])
    p = cost_link.predict([*RUN, "--world", "2"], Scheme(0), Network.capped(1, mbit))
    assert step == pytest.approx(p.step_s, abs=1e-3)
    assert p.across * 8 / (mbit * 1e6) == pytest.approx(p.comm_s, rel=0.01)  # the rate dominates
