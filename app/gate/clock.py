"""The hold clock: how long a slot is held on average, and from it when slots free (the ETA),
the Retry-After a refused request is told, and the promises behind those answers.

Standard library only. One moving average (`HOLD_EWMA_ALPHA`, `ewma`) serves the admission
core, the fair line's per-tenant charges and the shared line's replicas, so that every
estimate slotgate gives rests on one formula.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Collection, Iterator
from time import monotonic

#: A Retry-After above this is useless: the OpenAI Python SDK does not honour one past 60 s
#: and gives up past 120 s, so the estimate is capped well below both.
RETRY_AFTER_CAP_S = 60.0
#: While no hold has been seen, a refused request is told at most this many expected holds.
COLD_PROMISE_HOLDS = 2.0
#: A client told a moment comes back about then, give or take this (Retry-After in whole
#: seconds, its own latency): an arrival this close to a promised moment keeps that promise.
RETURN_GRACE_S = 0.5
#: Promises matched one by one to the moments places free (the cost of a refusal); the ones
#: further out count a place each.
MATCHED_PROMISES = 16
#: A burst's refusals are told within a fraction of this; a refused request that comes while
#: a promise at least this old is still ahead is taken for one of those clients back early.
EARLY_RETURN_S = 0.4
#: Until a hold has been observed or expected (`HoldClock.expect`), assume this one.
INITIAL_HOLD_S = 1.0
#: Weight of the newest observation in the moving average of slot hold times.
HOLD_EWMA_ALPHA = 0.2


def ewma(average_s: float, sample_s: float) -> float:
    """The moving average of hold times after one more hold of `sample_s`."""
    return average_s + HOLD_EWMA_ALPHA * (sample_s - average_s)


def retry_after(seconds: float) -> float:
    """A wait as told in Retry-After: at least 1 s (no hammering), at most RETRY_AFTER_CAP_S
    (no giving up)."""
    return min(max(seconds, 1.0), RETRY_AFTER_CAP_S)


class HoldClock:
    """The average hold, and from it the ETA of the next free slots and the promises told to
    refused requests. The admission core owns one and passes in what it knows: its capacity,
    the slots held, and `holds` (when granted, weight) of every holder, in the order granted.
    """

    __slots__ = ("_expected", "_jitter", "cold", "hold_s", "promised")

    def __init__(self) -> None:
        self.hold_s = INITIAL_HOLD_S
        self._expected = 0  # holds expected so far; -1 once a real one has been observed
        #: No hold has been observed yet: the estimate rests on `expect`, if anything. Kept,
        #: not computed: the request path reads it for every request.
        self.cold = True
        #: The moments refused requests were told a place should be free, and when each was
        #: told (`promise_s`), in the order of the moments.
        self.promised: list[tuple[float, float]] = []
        self._jitter = random.Random()  # noqa: S311 - spreading retries, not a secret

    def observe(self, hold_s: float) -> None:
        """A hold ended after `hold_s`: the moving average behind every estimate."""
        if self.cold:  # the first hold seen: a measurement beats a guess
            self.cold = False
            self._expected = -1
            self.hold_s = hold_s
        self.hold_s = ewma(self.hold_s, hold_s)

    def expect(self, hold_s: float) -> None:
        """A request about to enter should hold its slots about `hold_s`. Until a hold has
        been observed, the estimate is the mean of these; the first real one replaces it."""
        if self._expected < 0 or not math.isfinite(hold_s) or hold_s < 0:
            return
        self._expected += 1
        self.hold_s += (hold_s - self.hold_s) / self._expected

    def eta_s(
        self, position: int, capacity: int | None, active: int, holds: Collection[tuple[float, int]]
    ) -> float:
        """When the `position`-th slot to free from now should free, in seconds.

        The running generations end first, the longest-running first: each about an average
        hold after it began, or, once past that, after half as long again as it has run (a
        generation already long is likely a long one). After them each slot turns over once
        per average hold.
        """
        capacity = capacity or 1
        hold = self.hold_s
        rounds, index = divmod(max(position, 1) - 1, capacity)
        residual = 0.0
        if index < active:
            now = monotonic()
            slots = 0
            for granted_at in holds:  # in the order they were granted
                slots += granted_at[1]
                if slots > index:
                    elapsed = now - granted_at[0]
                    residual = max(hold - elapsed, elapsed / 2)
                    break
        return residual + rounds * hold

    def promise_s(
        self,
        capacity: int | None,
        holds: Collection[tuple[float, int]],
        kept: bool = False,
        record: bool = True,
    ) -> float:
        """The Retry-After of a request that the full line turns away: when a place is likely
        to be free for it. `kept`: its arrival kept a promise (`keep`).

        A place frees each time a slot does (the head of the line takes it), at the moments
        `_frees` estimates. Each refusal is promised the first such moment that no earlier
        promise still stands for (a little after it), so that a burst's clients come back
        spread over the moments places free up and the line refills as it drains; nobody is
        told to wait for the whole line. What a promise stands for is bounded three ways,
        none of which needs to know who a client is:

        - A promise stands for one moment near its own (within a step or RETURN_GRACE_S);
          promises beyond what the pool frees in that time (a cold burst told one guessed
          moment all together) push nobody further: their clients will be refused again and
          told then, counted once.
        - An arrival near a promised moment keeps that promise, which stops counting (it is
          that client back, or someone taking the place it stood for). A refused arrival
          that keeps none while a promise told at least EARLY_RETURN_S ago is still ahead
          takes that promise over: one client back early (ignoring Retry-After) stands for
          one place, however often it comes.
        - A moment that passes with nobody arriving shows its client is not coming: the
          promises told before it are forgotten with it.

        So the promises stand for at most the clients refused within EARLY_RETURN_S or kept
        coming since, each for one place the pool frees, and they drain as soon as clients
        stop coming back: an estimate stays when this client could expect a place.
        """
        now = monotonic()
        promised = self._purge(now)
        if not kept:
            early = now - EARLY_RETURN_S
            for i in range(min(len(promised), MATCHED_PROMISES)):
                if promised[i][1] <= early:
                    # Taken over: one back early. In place when recording (a storm keeps
                    # thousands of promises: copying them per refusal cost more than the rest).
                    if record:
                        del promised[i]
                    else:
                        promised = promised[:i] + promised[i + 1 :]
                    break
        hold = self.hold_s
        step = hold / (capacity or 1)
        near = max(step, RETURN_GRACE_S)
        # No hold seen yet: the guess errs late by design, and moments spaced by it would
        # leave slots idle for as long as it is wrong. Nobody is told more than two guessed
        # holds; by then real ones are known and a second refusal is precise.
        ceiling = COLD_PROMISE_HOLDS * hold if self.cold else RETRY_AFTER_CAP_S
        i = 0
        eta = RETRY_AFTER_CAP_S
        for matched, frees in enumerate(self._frees(now, capacity, holds)):
            frees = min(frees, ceiling)
            if frees >= RETRY_AFTER_CAP_S:
                break
            if matched == MATCHED_PROMISES:
                # Far enough out: the rest count a place each, each a step further.
                eta = min(frees + (len(promised) - i) * step, ceiling)
                break
            at = now + frees
            if i < len(promised) and promised[i][0] < at - near:
                # Those before stand for no moment the pool frees (they may still be kept).
                i = bisect.bisect_left(promised, (at - near, -math.inf), i)
            if i < len(promised) and promised[i][0] <= at + near:
                i += 1
                continue
            eta = frees
            break
        # Told the very moment a place should free, a client races the release it waits for;
        # a little later costs nothing while the line's waiters keep the slots busy. A
        # quarter of the step between places, and up to a quarter more at random to spread
        # a crowd.
        eta += step / 4
        if not record:
            return min(max(eta, 0.05), RETRY_AFTER_CAP_S)
        eta += self._jitter.uniform(0.0, step / 4)
        if eta < RETRY_AFTER_CAP_S:
            # Beyond the cap nothing is promised.
            bisect.insort(promised, (now + eta, now))
        return min(max(eta, 0.05), RETRY_AFTER_CAP_S)

    def keep(self, now: float) -> bool:
        """An arrival at `now`: the promise due nearest, if near enough, is kept by it (not
        one told so recently that its client cannot have waited half of it)."""
        promised = self._purge(now)
        if promised:
            moment, told = promised[0]
            if moment <= now + RETURN_GRACE_S and now - told >= (moment - told) / 2:
                del promised[0]
                return True
        return False

    def _frees(
        self, now: float, capacity: int | None, holds: Collection[tuple[float, int]]
    ) -> Iterator[float]:
        """When the slots free from now on, in seconds, earliest first: each held slot as
        `eta_s` has it, then every slot once per average hold."""
        capacity = capacity or 1
        hold = self.hold_s
        residuals: list[float] = []
        for granted_at, weight in holds:  # in the order they were granted
            elapsed = now - granted_at
            residuals += [max(hold - elapsed, elapsed / 2)] * weight
            if len(residuals) >= capacity:
                break
        residuals = residuals[:capacity]
        residuals += [0.0] * (capacity - len(residuals))
        heapq.heapify(residuals)
        while True:
            frees = residuals[0]
            yield frees
            heapq.heapreplace(residuals, frees + hold)

    def _purge(self, now: float) -> list[tuple[float, float]]:
        """Forget the moments that passed with nobody arriving, and every promise told
        before them: their clients are not all coming back."""
        promised = self.promised
        passed = bisect.bisect_left(promised, (now - RETURN_GRACE_S, -math.inf))
        if passed:
            before = max(told for _, told in promised[:passed])
            promised = self.promised = [p for p in promised[passed:] if p[1] > before]
        return promised
