"""Hung threaded checks are capped: each past its timeout holds a thread, replacements stop at the cap, and
checks beyond it time out as verifier_timeout instead of starting a thread each (500 hung checks left 501)."""

from __future__ import annotations

import asyncio
import threading

from rollflow.tasks.verify.threads import CheckThreads


def test_hung_checks_hold_at_most_the_cap_of_threads() -> None:
    release = threading.Event()
    threads = CheckThreads(threads=2, max_held=3)
    before = threading.active_count()

    async def main() -> list[bool]:
        async def one() -> bool:
            try:
                await threads.run(lambda: release.wait(30), timeout_s=0.05)
            except TimeoutError:
                return True
            return False

        return list(await asyncio.gather(*(one() for _ in range(40))))

    try:
        timed_out = asyncio.run(main())
        assert all(timed_out)
        assert threading.active_count() - before <= 2 + 3, threading.active_count() - before
    finally:
        release.set()
    # once the hung checks return, a check runs again
    assert asyncio.run(threads.run(lambda: 7, timeout_s=5)) == 7
