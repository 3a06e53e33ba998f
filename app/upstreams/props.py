"""What slotgate keeps from llama-server's `/props`: its slots, context, model, build and
default output limit, read from an answer it does not trust."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Props:
    """What slotgate keeps from llama-server's /props."""

    total_slots: int
    n_ctx: int | None
    model: str | None
    build_info: str | None
    #: llama-server's own output limit for a request that sets none or -1 (its -n); None =
    #: unbounded (-1, its default).
    n_predict: int | None = None

    @classmethod
    def parse(cls, body: Any) -> Props:
        if not isinstance(body, dict):
            raise ValueError("/props did not answer a JSON object")  # noqa: TRY004 - bad data, not a bad call
        slots = body.get("total_slots")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"/props total_slots is {slots!r}, not a positive integer")
        settings = body.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        model = body.get("model_alias") or body.get("model_path")
        build = body.get("build_info")
        params = settings.get("params") if isinstance(settings, dict) else None
        n_predict = params.get("n_predict") if isinstance(params, dict) else None
        return cls(
            slots,
            n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else None,
            model if isinstance(model, str) else None,
            build if isinstance(build, str) else None,
            n_predict if isinstance(n_predict, int) and n_predict >= 0 else None,
        )


__all__ = ["Props"]
