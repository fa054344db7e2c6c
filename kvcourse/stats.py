"""KV memory accounting shared by every stage: bytes reserved versus bytes holding live tokens."""

from __future__ import annotations

from dataclasses import dataclass


def format_bytes(n: float) -> str:
    """Human-readable size in binary units.

    Examples: ``format_bytes(512) -> '512 B'``, ``format_bytes(46080) -> '45.0 KiB'``.
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KvUsage:
    """Peak KV memory of a run: what the stage set aside, and what actually held tokens' K and V."""

    reserved_bytes: int
    live_bytes: int

    @property
    def utilization(self) -> float:
        """Fraction of the reserved bytes that held live tokens (1.0 = nothing wasted)."""
        return self.live_bytes / self.reserved_bytes if self.reserved_bytes else 0.0

    def __str__(self) -> str:
        return (
            f"KV reserved {format_bytes(self.reserved_bytes)}, live {format_bytes(self.live_bytes)} "
            f"({100 * self.utilization:.1f}% used)"
        )
