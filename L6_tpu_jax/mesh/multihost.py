"""L6 over a device mesh and across hosts: the mesh, reading replicated state, and the same-call guard.

A JAX program on several hosts (Levanter's TPU slices, or here several processes on one machine) is
*multi-controller*: every host runs the same Python program, and each jit'd call is one SPMD program
over every device of the global mesh. A host that calls something the others don't, or the same thing
with another shape, leaves the others waiting in a collective: on a TPU slice that is a hang or an
XLA crash with no Python traceback. This file holds the three pieces ``engine.py`` needs for that
world:

- ``data_mesh``: a one-axis ``Mesh`` named ``data`` over the given devices (default: every device of
  every process). The mesh engine cuts its slots and its KV pages into one equal range per device along it.
- ``local_copy``: a NumPy copy of replicated device state, read from this host's own copy.
  ``jax.device_get`` refuses an array that spans other processes' devices, even a replicated one.
- ``check_same_call``: before a jit call, every host sends a short description of the call it is
  about to make (its index, name, shapes, and a checksum of its inputs) to every other host; if they
  differ, every host raises ``HostDivergenceError`` naming the call on each side, instead of entering
  a program the others will not run.

Left out on purpose: a ``model`` axis (sharding heads; the course model has 3 KV heads, see the
chapter, section 12), process groups other than "all", and timeouts (the launcher,
``../l6_multihost.py``, has one for the whole run).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

DATA = "data"  # the mesh axis that sequences and their KV pages are split over
DESCRIPTION_BYTES = 200  # a call's description, padded: every host sends the same number of bytes


class HostDivergenceError(RuntimeError):
    """Hosts were about to make different jit calls (or the same one with other shapes or inputs)."""


def data_mesh(devices=None) -> Mesh:
    """A mesh with one axis, ``data``, over ``devices`` (default: all devices of all processes).

    Example: 2 processes with 2 CPU devices each -> ``Mesh(shape={'data': 4})``; process 0 holds
    devices 0 and 1, so the engine's shards 0 and 1 (their slots and pages) live in process 0.
    """
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DATA,))


def local_copy(tree):
    """NumPy copies of a pytree of replicated arrays, each read from this process's first copy.

    Every device holds the whole value of a replicated array, so any addressable copy is the value.
    Non-array leaves pass through.
    """
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)


def describe(index: int, call: str) -> np.ndarray:
    """``f"#{index} {call}"`` as DESCRIPTION_BYTES uint8, zero-padded (longer text is cut).

    Example: ``describe(3, "decode(width=4)")`` -> the bytes of ``#3 decode(width=4)`` then zeros.
    """
    raw = f"#{index} {call}".encode()[:DESCRIPTION_BYTES]
    return np.frombuffer(raw.ljust(DESCRIPTION_BYTES, b"\0"), np.uint8)


def check_same_call(index: int, call: str) -> None:
    """Raise ``HostDivergenceError`` on every host unless all hosts are about to make the same call.

    ``index`` counts this host's jit calls since the engine was built; ``call`` names the call with
    its shapes and an input checksum. One small all-gather (DESCRIPTION_BYTES per host) over all
    processes; with one process there is nothing to compare.
    """
    if jax.process_count() == 1:
        return
    everyone = multihost_utils.process_allgather(describe(index, call))  # (processes, DESCRIPTION_BYTES)
    calls = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in np.asarray(everyone)]
    if len(set(calls)) > 1:
        sides = ", ".join(f"host {i}: {c}" for i, c in enumerate(calls))
        raise HostDivergenceError(
            f"hosts diverged before jit call #{index} (this is host {jax.process_index()}): {sides}"
        )
