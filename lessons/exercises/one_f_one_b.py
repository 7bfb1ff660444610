"""Exercise 1f1b (lesson 08): the 1F1B schedule of one pipeline rank, as rounds of ops.

p stages, this is stage `rank` (0 = first), m micro-batches. A schedule is a list of rounds; a round
is a list of Op("F", mb) / Op("B", mb) that run back to back (the pipeline's p2p happens between
rounds). 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs in three phases: a warm-up of forwards
that fills the pipeline, a steady state alternating one forward with one backward (of the oldest
micro-batch in flight), and a cool-down of the backwards left. The invariants to build it from:
    - a stage runs the next forward only while fewer than p - rank micro-batches are in flight on it
      (activation memory ∝ p, not m as in GPipe), so the last stage runs each backward right after
      its forward;
    - every micro-batch 0 .. m-1 gets exactly one forward and then one backward, in order; and m may
      be smaller than p.
Here every op is a round of its own: [[Op("F", 0)], [Op("F", 1)], [Op("B", 0)], ...].
Example, p = 4, m = 6: rank 0 runs F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5; rank 3 runs F0 B0 F1 B1 ...
F5 B5.
Use nanomega's Op (the pipeline and the simulator test isinstance(step, Op)). `v` (virtual stages)
is 1 here.

Replaces nanomega/schedules.py:one_f_one_b in the tests (the op orders, and the unit-clock
simulator's bubble).
Grade:  python lessons/check.py --exercise 1f1b lessons/exercises/one_f_one_b.py
"""


def one_f_one_b(p, rank, m, v=1):
    # warmup = ...; rounds = warm-up forwards + steady (F then B) + cool-down backwards
    raise NotImplementedError("exercise 1f1b: write the schedule")
