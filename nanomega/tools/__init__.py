"""Commands around training: the cluster planner (plan.py, over cost.py: what one layout costs),
transformers interchange (hf.py), pictures of runs (plot.py), sampling (sample.py), corpus
preparation (corpus.py) and tokenizer training (tokenizer.py). Each command is a console script
(pyproject [project.scripts]) and `python -m nanomega.tools.NAME`. preflight.py is train.py's: the
memory check at start-up and --dry-run.
Lesson: lessons/21-planning-a-run.md (the planner); the others are shown in lesson 01.
"""
