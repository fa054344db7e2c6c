"""L3's exercise checkers (``checks.py``) and the grader's independent answers (``answers.py``): not the lesson."""
