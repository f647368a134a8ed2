"""What a reply said, as a multiset of its scalars: a row keeps a reply whole when none of them is lost."""

from __future__ import annotations

from collections import Counter
from typing import Any

# Keys that name a shape, not something the model said: they differ between the two shapes by design.
STRUCTURAL = frozenset({"object", "role", "type", "index"})


def leaves(value: Any, skip: frozenset[str] = STRUCTURAL) -> Counter[str]:
    """Every scalar the JSON holds (but under shape keys), counted: what a reply said, as a multiset."""
    out: Counter[str] = Counter()
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in skip:
                out += leaves(item, skip)
    elif isinstance(value, list):
        for item in value:
            out += leaves(item, skip)
    elif value is not None and value != "":
        out[repr(value)] += 1
    return out
