"""The one exception the data package raises for problems the user fixes (a path, a dtype, a vocabulary)."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A user-fixable data problem; ``str(exc)`` is one line naming the file (and position) and what to change."""
