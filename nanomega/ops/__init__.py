"""Running a job, not a concept of parallelism: the flags and their checks (args.py, presets.py), what a long run
meets (faults.py: out-dir lock, preemption, hang watchdog, spikes), the health check (health.py) and the meter
(meter.py: MFU and memory). Lesson: lessons/12-when-training-breaks.md. Imports: concepts only, never tools/."""
