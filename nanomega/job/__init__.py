"""Running a job, not a concept of parallelism: the flags as a frozen Config, declared and parsed,
and their pure checks (config.py, flags.py, checks.py, presets.py), what a long run meets around its
steps (faults.py: out-dir lock, resume discovery; lifecycle.py: preemption, errors) and inside one
(guard.py: hang watchdog, spikes, NaN, --inject-fault), when to checkpoint and how to load it back
(saves.py), the health check (health.py) and the meter (meter.py: MFU and memory).
Lesson: lessons/20-when-training-breaks.md. Imports: concepts only, never tools/."""
