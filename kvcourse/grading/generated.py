"""Files the course generates from others (exercise notebooks, stage diffs): write or check one.

Both ``make exercises`` and ``make diffs`` render a file's text, then either write it (only when it
changed, so timestamps stay put) or, with ``--check``, report whether the committed file is current.
"""

from __future__ import annotations

from pathlib import Path


def sync(path: Path, text: str, check: bool) -> bool:
    """Write ``text`` to ``path`` unless it is already there or ``check`` is set; return True if the
    file on disk was (or, with ``check``, is) different from ``text``.

    Example: ``sync(p, "a\\n", check=True)`` on a missing ``p`` returns True and writes nothing.
    """
    current = path.read_text(encoding="utf-8") if path.exists() else None
    if current != text and not check:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return current != text
