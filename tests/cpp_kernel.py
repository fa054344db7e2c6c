"""Whether the stages' C++ kernel can run here: tests that need it skip, saying why, where it cannot."""

from __future__ import annotations

import pytest

from kvcourse.cpp_kernels import build_problem
from L4_paged_kernel.fast.cpp_paged_attention import SOURCE

PROBLEM = build_problem(SOURCE)  # None where make setup built it (L5's copy is byte-identical)
needs_cpp = pytest.mark.skipif(PROBLEM is not None, reason=f"no C++ kernel on this machine: {PROBLEM}")
