"""kvcourse: the course's shared layer (model parts, model store, prompts, HF reference, comparison,
smoke harness, grading harness, device choice). No module here imports a stage.

Importing it changes nothing in the environment: which device runs is the caller's choice
(``kvcourse.devices``), and the stages' Triton kernels pick compiled or interpreted execution by the
device of the tensors they are given, not by the machine.
"""
