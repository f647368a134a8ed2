"""The engine's prefix cache, as vLLM counts it: a prompt seen recently (an LRU of prompts) is a hit, and
its tokens are not prefilled again. So routing a task's repeats to one replica shows as a higher hit rate.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import orjson

from rollflow.infra.simulator.capacity import Counters


class PrefixCache:
    """The last `size` prompts (by content); `lookup` counts queried and hit tokens as vLLM's counters do."""

    def __init__(self, size: int, counters: Counters) -> None:
        self.size = size
        self.counters = counters
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, messages: object, tokens: int) -> bool:
        """Whether the prompt is cached (then it moves to the newest place); counts `tokens` either way."""
        key = hashlib.blake2b(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
        c = self.counters
        c.prefix_queries += tokens
        if key in self._seen:
            self._seen.move_to_end(key)
            c.prefix_hits += tokens
            return True
        self._seen[key] = None
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return False
