"""How an error message shows a bad input value: its repr, cut to one short line.

Inputs come from JSON, the environment and HTTP requests, so a bad value may be a
100,000-character string, an integer with thousands of digits (whose ``repr`` raises
ValueError beyond Python's 4,300-digit limit) or a list nested past the recursion limit
(whose ``repr`` raises RecursionError). Every message that names a value goes through
``short_repr`` so that it stays one readable line and never raises itself.
"""

from __future__ import annotations

import math

MAX_CHARS = 80  # of the shown repr; the rest is elided
MAX_INT_BITS = 128  # integers wider than this are shown by their size (about 39 digits)


def short_repr(value: object) -> str:
    """``repr(value)`` on one line of at most MAX_CHARS characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        digits = math.floor(value.bit_length() * math.log10(2)) + 1
        return f"<{'-' if value < 0 else ''}integer of about {digits} digits>"
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        return f"<{type(value).__name__} too deep or large to show>"
    text = text.replace("\n", "\\n")
    if len(text) > MAX_CHARS:
        tail = f"... ({len(text)} chars)"
        return text[:MAX_CHARS - len(tail)] + tail
    return text
