"""Several local engines side by side: replicas of one engine, each on its own loopback port
with its own slots, CPU threads and environment (its GPU), started and stopped together.
Standard library only, as the whole of `engine/` is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Unpack

from slotgate.engine.model import EngineFailed, EngineMisconfigured
from slotgate.engine.process import (
    HEALTH_POLL_S,
    EngineFlags,
    LocalEngine,
    default_threads,
    free_ports,
)


def split_threads(total: int, replicas: int) -> list[int]:
    """`total` CPU threads shared out among `replicas` engines, the first ones taking the
    remainder, and each at least 1: 7 among 2 is [4, 3], 1 among 2 is [1, 1]."""
    share, extra = divmod(total, replicas)
    return [max(1, share + (index < extra)) for index in range(replicas)]


class Engines:
    """Replicas of one local engine, each on its own loopback port with its own slots, CPU
    threads and environment (its GPU): the upstreams of one slotgate. Iterable and indexed
    from 0; the log numbers them from 1.

    They start side by side and stop side by side; one that ends by itself is reported by
    `ended()`, and the rest keep running. Call `start()` and `stop()` from one thread.
    """

    def __init__(self, engines: Sequence[LocalEngine]) -> None:
        if not engines:
            raise ValueError("Engines needs at least one engine")
        self._engines = list(engines)
        self._reported: set[int] = set()

    @classmethod
    def from_args(
        cls, *, replicas: int = 1, gpus: Sequence[str] = (), **flags: Unpack[EngineFlags]
    ) -> Engines:
        """The engines slotgate's engine flags and --replicas/--gpus ask for.

        --parallel and --ctx-size shape each engine; so does --threads when given, while
        `threads=None` shares `default_threads()` out among the replicas (`split_threads`).
        `gpus`, one per replica, become each one's CUDA_VISIBLE_DEVICES. With more than one
        replica, each logs as `slotgate.engine.<n>`.
        """
        if gpus and len(gpus) != replicas:
            raise EngineMisconfigured(
                f"--gpus names {len(gpus)} GPU{'' if len(gpus) == 1 else 's'} for {replicas} "
                "replicas; give one GPU per replica"
            )
        threads = flags["threads"]
        shares = [threads] * replicas if threads else split_threads(default_threads(), replicas)
        flags["threads"] = shares[0]
        first = LocalEngine.from_args(**flags)
        engines = [first] + [first.twin(threads=share) for share in shares[1:]]
        for number, engine in enumerate(engines, 1):
            if replicas > 1:
                engine.log = logging.getLogger(f"slotgate.engine.{number}")
            if gpus:
                engine.env["CUDA_VISIBLE_DEVICES"] = gpus[number - 1]
        return cls(engines)

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[LocalEngine]:
        return iter(self._engines)

    def __getitem__(self, index: int) -> LocalEngine:
        return self._engines[index]

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self._engines]

    @property
    def kv_budget_tokens(self) -> int:
        """KV_BUDGET_TOKENS for each engine (they are alike)."""
        return self._engines[0].kv_budget_tokens

    def name(self, number: int) -> str:
        """How the log names engine `number` (from 1): its URL, and which of how many."""
        engine = self._engines[number - 1]
        if len(self._engines) == 1:
            return engine.url
        return f"{number} of {len(self._engines)} at {engine.url}"

    def start(self) -> None:
        """Start every engine at once, each on a port of its own, and block until all answer
        /health; on any failure stop them all and raise EngineFailed naming the one."""
        ports = free_ports(len(self._engines))
        try:
            for engine, port in zip(self._engines, ports, strict=True):
                engine.launch(port)
            waiting = list(enumerate(self._engines, 1))
            while waiting:
                waiting = [(number, engine) for number, engine in waiting
                           if not self._ready(number, engine)]  # fmt: skip
                if waiting:
                    time.sleep(HEALTH_POLL_S)
        except BaseException:
            self.stop()
            raise

    def _ready(self, number: int, engine: LocalEngine) -> bool:
        try:
            return engine.ready()
        except EngineFailed as exc:
            if len(self._engines) == 1:
                raise
            raise EngineFailed(f"replica {self.name(number)}: {exc}") from None

    def ended(self) -> list[tuple[int, int]]:
        """The engines that ended by themselves since the last call: (number, exit code)."""
        found = []
        for number, engine in enumerate(self._engines, 1):
            if number not in self._reported and (code := engine.poll()) is not None:
                self._reported.add(number)
                found.append((number, code))
        return found

    @property
    def running(self) -> int:
        """How many engines `ended()` has not reported ended (one that ends meanwhile is
        counted as running until it is reported, so that counts and reports agree)."""
        return len(self._engines) - len(self._reported)

    def stop(self) -> None:
        """Stop every engine: all are asked at once, then each is waited for and reaped."""
        for engine in self._engines:
            engine.terminate()
        for engine in self._engines:
            engine.stop()
