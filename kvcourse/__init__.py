"""kvcourse: the course's shared layer (model parts, model store, prompts, HF reference, comparison,
smoke harness, grading harness). No module here imports a stage.

Importing it also settles one thing that has to happen before anything imports ``triton``: on a
machine without an NVIDIA GPU (no ``nvidia-smi``), and unless ``TRITON_INTERPRET`` is already set,
Triton kernels must run in Triton's interpreter, so ``TRITON_INTERPRET=1`` is set here.
``TRITON_INTERPRET_SET_HERE`` records that, so that the Triton kernel module can say so when it loads.
"""

import os
import shutil

TRITON_INTERPRET_SET_HERE = "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None
if TRITON_INTERPRET_SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"
