"""The course's stages by short name, and a way to build any stage's engine from its name.

Example: ``engine_class("L1")`` imports ``L1_contiguous.engine`` and returns its ``Engine``.
"""

from __future__ import annotations

import importlib

STAGES = {
    "L1": "L1_contiguous",
    "L2": "L2_token_flat",
    "L3": "L3_block_tensor",
    "L4": "L4_paged_kernel",
    "L5": "L5_clones",
    "L6": "L6_tpu_jax",
}


def engine_class(stage: str):
    """The ``Engine`` class of ``stage`` ("L1".."L6")."""
    key = stage.upper()
    if key not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    try:
        module = importlib.import_module(f"{STAGES[key]}.engine")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith(STAGES[key]):
            raise ValueError(f"stage {key} ({STAGES[key]}/) is not in this checkout yet") from None
        raise
    return module.Engine
