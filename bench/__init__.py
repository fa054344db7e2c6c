"""Benchmarks: every stage against Hugging Face and against the machine's own ceilings, in one run.

Each bench module imports torch before ``kvcourse``, so ``kvcourse``'s default of
``OMP_WAIT_POLICY=PASSIVE`` comes after torch's OpenMP has read its setting and changes nothing here:
a benchmark runs with the policy its caller set, or OpenMP's own default when unset.
``OMP_WAIT_POLICY`` is that value, read before anything else, and the results that depend on it record it.
"""

import os

OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "(unset)")
