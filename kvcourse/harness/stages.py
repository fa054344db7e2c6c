"""The course's stages by short name, a way to build any stage's engine from its name, and the options
an engine takes.

Example: ``engine_class("L1")`` imports ``L1_contiguous.engine`` and returns its ``Engine``;
``engine_options(engine_class("L2"))`` -> ``{"max_model_len": None, "block_size": 16, "num_blocks": None}``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from kvcourse.engine_config import EngineConfig

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


def engine_options(engine_cls) -> dict:
    """The keyword options an engine class takes, each with its default: its own keyword parameters (L4's
    ``kernel``, L6's ``page_size``, ...) and the shared ones it names in ``OPTIONS``, whose defaults are
    ``kvcourse.engine_config.EngineConfig``'s. ``model_dir`` and ``device`` are left out."""
    params = inspect.signature(engine_cls).parameters.values()
    own = {
        p.name: p.default
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("model_dir", "device")
    }
    shared = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    return own | {name: shared[name] for name in getattr(engine_cls, "OPTIONS", ())}
