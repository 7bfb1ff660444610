"""Solution of exercise 1f1b (lessons/exercises/one_f_one_b.py)."""

from nanomega.schedules import Op


def one_f_one_b(p, rank, m, v=1):
    warmup = min(p - rank - 1, m)
    rounds = [[Op("F", i)] for i in range(warmup)]  # warm-up: fill the pipeline
    # steady state: one forward, one backward
    for i in range(m - warmup):
        rounds += [[Op("F", warmup + i)], [Op("B", i)]]
    return rounds + [[Op("B", i)] for i in range(m - warmup, m)]  # cool-down: drain the rest
