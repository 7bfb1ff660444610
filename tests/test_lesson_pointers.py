"""Every exercise (lessons/grade.py's EXERCISES) and every prediction (lessons/predict.py's QUESTIONS)
is named in the text of the lesson it belongs to: `--exercise NAME` for an exercise, the question's
key in backquotes for a prediction. A reader meets them where the idea is taught."""

import importlib
import sys
from pathlib import Path

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
sys.path.insert(0, str(LESSONS))


def lesson_text(number):
    (path,) = LESSONS.glob(f"{number}-*.md")
    return path.read_text()


def test_each_lesson_points_to_its_exercises_and_predictions():
    grade, predict = importlib.import_module("grade"), importlib.import_module("predict")
    missing = [
        f"lesson {e.lesson}: --exercise {name}"
        for name, e in grade.EXERCISES.items()
        if f"--exercise {name}" not in lesson_text(e.lesson)
    ]
    missing += [
        f"lesson {number}: `{key}`"
        for key, (number, _) in predict.QUESTIONS.items()
        if f"`{key}`" not in lesson_text(number)
    ]
    assert not missing, f"not named in their lesson: {missing}"
