"""Small text helpers shared by the built-in scorers.

The one choice made here: a completion is cleaned the same way by every scorer. End-of-text
markers that survived decoding (``<|im_end|>``, ``<|endoftext|>``, ``</s>``...) end the
completion: everything from the first one on is dropped.
"""

from __future__ import annotations

import re

END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
_END_RE = re.compile("|".join(re.escape(m) for m in END_MARKERS))


def cut_at_end_marker(text: str) -> str:
    """``text`` up to (not including) the first end-of-text marker, if any."""
    match = _END_RE.search(text)
    return text if match is None else text[: match.start()]


def last_tag_content(text: str, tag: str) -> str | None:
    """The content of the last complete ``<tag>...</tag>`` pair in ``text``, or None."""
    close = f"</{tag}>"
    end = text.rfind(close)
    if end < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : end]
