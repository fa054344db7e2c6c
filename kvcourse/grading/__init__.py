"""Grading: the notebooks' check cases, hidden cases, integrity scan, sandbox, gradebook, the generated
exercise notebooks and the learner's workspace. It names no stage: it finds them through the harness."""
