"""Which device a stage runs on, decided in one place: ``resolve_device`` (torch), ``jax_device`` (JAX).

Every engine of L1-L5 takes ``device=`` ("cpu", "cuda", "cuda:N" or a ``torch.device``) and puts its
weights, KV pool, block tables and step metadata there; L6 takes the same names and resolves them to a
JAX device with ``jax_device``. The smoke scripts, the CLI, the benchmark and
``python -m kvcourse.tools.gpu_check`` take ``--device cpu|cuda``, whose default is the environment variable
``KVCOURSE_DEVICE``, else the CPU. All of them resolve the name here, so a bad one is refused the same
way everywhere::

    resolve_device("cpu")    -> device(type='cpu')
    resolve_device("cuda")   -> device(type='cuda')   where torch sees a CUDA GPU; elsewhere ValueError:
                                device 'cuda': no CUDA device (torch.cuda.is_available() is False)
    resolve_device("tpu")    -> ValueError: device 'tpu': choose cpu, cuda or cuda:N

Exact equality on a GPU: NVIDIA GPUs can multiply fp32 matrices in TF32 (a 10-bit mantissa) when
allowed, which changes logits by far more than the course's tie rule tolerates. Resolving a CUDA device
therefore calls ``exact_fp32()``, which turns TF32 off for the whole process (matmuls and cuDNN
convolutions) and asks for "highest" float32 matmul precision; every process that compares (smoke,
tests, CLI, GPU check, the HF reference) resolves its device through here first.

The KV pool as a share of a GPU (``gpu_memory_utilization=``, as vLLM's option of that name):
``kv_bytes_for_fraction`` (torch) gives the KV cache ``fraction`` x the device's total memory, less the
memory in use once the weights are loaded and the peak a profiled forward of a full step adds; vLLM v1
does the same (``available_kv_cache_memory_bytes = requested_memory - non_kv_cache_memory`` in
``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``). ``jax_kv_bytes_for_fraction`` does it
from JAX's allocator statistics, without an activation profile. Both need a GPU: the course's
2-core CI machine has none, so they are implemented but not verified there.

Left out on purpose: several GPUs per engine, other accelerator backends in torch (MPS, XPU; the
course checks cpu and cuda only), and mixed precision.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "KVCOURSE_DEVICE"


def default_device() -> str | None:
    """The device the scripts use when ``--device`` is not given: ``$KVCOURSE_DEVICE``, or None (the
    CPU for the torch stages)."""
    return os.environ.get(DEVICE_ENV) or None


def exact_fp32() -> None:
    """fp32 matmuls and convolutions in full fp32 on CUDA (no TF32), for this whole process."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def resolve_device(device: str | torch.device | None = "cpu", what: str | None = None) -> torch.device:
    """The ``torch.device`` that ``device`` names (None means the CPU), refused with a ValueError where
    it is not a CPU or an available CUDA device. ``what`` is how the message names the value (default
    ``device 'cuda'``; the scripts say ``--device cuda``). A CUDA device also switches TF32 off.

    Example on a machine without a GPU: ``resolve_device("cuda", what="--device cuda")`` raises
    ``ValueError: --device cuda: no CUDA device (torch.cuda.is_available() is False)``.
    """
    what = what or f"device {str(device)!r}"
    try:
        resolved = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what}: choose cpu, cuda or cuda:N") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"{what}: choose cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"{what}: no CUDA device (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(f"{what}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    exact_fp32()
    return resolved


def describe(device: torch.device) -> str:
    """A device as a report names it: ``cpu``, or with the GPU's name, ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if device.type != "cuda":
        return str(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")


def profile_forward(model, num_tokens: int) -> None:
    """One forward of ``num_tokens`` tokens in one sequence, attention with no cache (causal SDPA):
    the activation peak of the largest step an engine runs, for ``kv_bytes_for_fraction``."""
    cfg, device = model.cfg, model.device
    group = cfg.num_heads // cfg.num_kv_heads

    def attend(layer, q, k, v):  # q: (T, H, D); k, v: (T, H_kv, D)
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # (H, T, D)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1)  # (T, H, D)

    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)  # (T,)
    model.forward(ids, torch.arange(num_tokens, device=device), attend, logits_at=ids[-1:])


def kv_bytes_for_fraction(device: torch.device, fraction: float, profile) -> int:
    """KV bytes for ``gpu_memory_utilization=fraction`` on a CUDA device, as vLLM v1 reads the setting: a
    limit for this process alone, ``fraction`` x the card's memory, less what this process holds
    (the weights, anything torch keeps cached) and the peak ``profile()`` adds. Another process's memory
    is not subtracted; the fraction must fit in what is free or already this process's, else it is
    refused (vLLM's ``request_memory`` refuses the same way, in ``vllm/v1/worker/utils.py``).

    Example on an 80 GiB card, 0.6 GiB held by this process, a 1.4 GiB activation peak: 0.9 -> 70 GiB,
    whatever other processes hold, as long as 72 GiB is free or this process's.
    Elsewhere: ``ValueError: gpu_memory_utilization needs a CUDA device, got cpu``.
    """
    check_fraction(fraction)
    if device.type != "cuda":
        raise ValueError(f"gpu_memory_utilization needs a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    ours = torch.cuda.memory_reserved(device)  # this process's torch memory: the weights, its caches
    requested = int(fraction * total)
    if requested > free + ours:
        raise ValueError(
            f"gpu_memory_utilization={fraction} asks for {requested:,} bytes of the card's {total:,}, but only "
            f"{free + ours:,} are free or this process's ({total - free - ours:,} held elsewhere): "
            f"lower gpu_memory_utilization or free the card"
        )
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile()
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    kv_bytes = requested - ours - activations
    if kv_bytes <= 0:
        raise ValueError(
            f"gpu_memory_utilization={fraction} leaves no KV memory: {fraction} x {total:,} bytes, less "
            f"{ours:,} this process holds and {activations:,} of activations, is {kv_bytes:,} bytes"
        )
    return kv_bytes


def jax_kv_bytes_for_fraction(device, fraction: float) -> int:
    """KV bytes for ``gpu_memory_utilization=fraction`` on a JAX GPU: fraction x the allocator's limit
    (``memory_stats()["bytes_limit"]``), less its peak use so far (the weights; activations are not
    profiled, as JAX allocates them inside compiled calls)."""
    check_fraction(fraction)
    stats = device.memory_stats() if device.platform == "gpu" else None
    if not stats:
        raise ValueError(f"gpu_memory_utilization needs a GPU, got {device.platform}")
    kv_bytes = int(fraction * stats["bytes_limit"]) - stats["peak_bytes_in_use"]
    if kv_bytes <= 0:
        raise ValueError(f"gpu_memory_utilization={fraction} leaves no KV memory ({kv_bytes:,} bytes)")
    return kv_bytes


def jax_device(device: str = "cpu"):
    """The JAX device a name picks: ``"cpu"``; ``"cuda"`` or ``"gpu"`` (JAX's GPU backend); ``"tpu"``;
    each may end in ``":N"``, the N-th such device of this process.

    Example: ``jax_device("cpu")`` -> ``CpuDevice(id=0)``. On a machine without a GPU, ``jax_device("cuda")``
    raises ``ValueError: device 'cuda': JAX has no 'cuda' backend here (it has: cpu)``.
    """
    import jax

    platform, _, index = device.partition(":")
    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError:
        have = ", ".join(sorted({jax.default_backend(), "cpu"}))
        raise ValueError(
            f"device {device!r}: JAX has no {platform!r} backend here (it has: {have})"
        ) from None
    if not index:
        return devices[0]
    if not index.isdigit() or int(index) >= len(devices):
        raise ValueError(f"device {device!r}: JAX has {len(devices)} {platform} device(s), numbered from 0")
    return devices[int(index)]


def describe_jax_device(device) -> str:
    """A JAX device as a report names it: ``platform:id (kind)``, e.g. ``cpu:0 (cpu)`` or
    ``gpu:0 (NVIDIA H100 80GB HBM3)``."""
    return f"{device.platform}:{device.id} ({device.device_kind})"


def add_device_argument(parser) -> None:
    """A script's ``--device`` flag (validated by ``device_argument``)."""
    parser.add_argument("--device", help=f"cpu or cuda (default: ${DEVICE_ENV}, else cpu)")


def device_argument(value: str | None) -> str | None:
    """The device a script was asked for: ``--device``'s value, else ``$KVCOURSE_DEVICE``, else None
    (the CPU). Refused with a ValueError naming where the value
    came from, e.g. ``--device cuda: no CUDA device (torch.cuda.is_available() is False)``."""
    what = f"--device {value}"
    if value is None and default_device() is not None:
        value = default_device()
        what = f"{DEVICE_ENV}={value}"
    if value is not None:
        resolve_device(value, what)
    return value
