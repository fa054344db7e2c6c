"""Benchmarks: every stage against Hugging Face and against the machine's own ceilings, in one run.

    run          ``make bench``'s main part (workloads (a), (b), (u), (c)-(f)), with ``systems`` (the
                 stages and the HF peers), ``workloads``, ``measure`` (timing, agreement, provenance),
                 ``ceilings`` (copy bandwidth and matmul rate) and ``report`` (tables, targets, plots)
    kernels      the paged kernels alone, decode and prefill, against SDPA and the copy bandwidth
                 (``triton_sequence_grid``: the Triton kernel as it was before query tiles)
    serving      a request stream served in real time at a fixed KV memory (the vLLM paper's test)
    simulate     the same test at the paper's scale, on a simulated clock with a step-cost model fitted
                 here (``--calibrate``) or taken from committed GPU runs (``--gpu-profile``)
    profile      where a step's time goes; ``decode_cost``, ``reference_kernel``, ``matvec``,
                 ``sharing`` and ``beam_memory``: the chapters' single-purpose tables
    l6_compile   what L6's first run compiles, its layers unrolled against scanned
    agreement    which of L4's kernels and fast paths moves a token away from HF batch 1 on (b)

Each bench module imports torch before ``kvcourse``, so ``kvcourse``'s default of
``OMP_WAIT_POLICY=PASSIVE`` comes after torch's OpenMP has read its setting and changes nothing here:
a benchmark runs with the policy its caller set, or OpenMP's own default when unset.
``OMP_WAIT_POLICY`` is that value, read before anything else, and the results that depend on it record it.
"""

import os

OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "(unset)")
