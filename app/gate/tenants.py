"""Tenants: whom a request is for, and the share of the slots each may have (API_KEYS_FILE).

Standard library only. With no keys at all there is one tenant, `EVERYONE`. With `API_KEYS`
each key is its own tenant, named `key-` and the first 8 hex digits of the key's SHA-256 (a
label, not a secret), weight 1, band `interactive`. `API_KEYS_FILE` names a TOML file for more:

    [tenants.chat]
    key = "sk-chat-..."              # or keys = [...], or sha256 = "<64 hex>" (or a list)
    weight = 3                       # its share of slot time beside the others (default 1)
    band = "interactive"             # or "batch", or 0..9: a higher band is served first
    max_active = 2                   # slots it may hold at once (default: no limit)
    max_queued = 32                  # its waiters in the line (default: only the line's limit)
    requests_per_minute = 60         # quotas (app/gate/quotas.py; default: none)
    tokens_per_minute = 20000
    tokens_per_day = 1000000
    max_wait_s = 30                  # its requests' bound on waiting, unless X-Max-Wait says

Bands are integers from 0 to 9, the higher served first; `batch` is 0 and `interactive` (the
default) is 1. A request may ask for a lower band than its key's with `X-Priority` (a band's
name or number), never for a higher one.

`Tenant`s are immutable: a reload (SIGHUP) builds a new `Roster` and swaps it in whole, so a
request keeps the tenant it was identified as until it ends, while new requests see the new
file. The fair line (app/gate/fairline.py) keys its accounts by the tenant's name, so a reloaded
tenant keeps its place and its history.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import re
import signal
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotgate.errors import InvalidTenantsFile
from slotgate.gate.deadlines import MAX_WAIT_S
from slotgate.gate.quotas import LIMITS, MAX_LIMIT, Quota

log = logging.getLogger("slotgate")

BATCH = 0
INTERACTIVE = 1
MAX_BAND = 9
BANDS = {"batch": BATCH, "interactive": INTERACTIVE}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = (
    "key",
    "keys",
    "sha256",
    "weight",
    "band",
    "max_active",
    "max_queued",
    "max_wait_s",
    *LIMITS,
)


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is for: a name (for logs, metrics and /admission, never a key) and its
    share. `weight` is its share of slot time beside the other tenants of its band."""

    name: str
    weight: float = 1.0
    band: int = INTERACTIVE
    max_active: int | None = None
    max_queued: int | None = None
    #: Its quotas; None when it has none (the request path then skips them at no cost).
    quota: Quota | None = None
    #: How long its requests may wait for a slot when they do not say (app/gate/deadlines.py).
    max_wait_s: float | None = None

    def lowered(self, band: int) -> Tenant:
        """The same tenant for a request in a lower `band` (X-Priority); itself for any
        other."""
        if band >= self.band:
            return self
        return Tenant(
            self.name, self.weight, band, self.max_active, self.max_queued, self.quota,
            self.max_wait_s,
        )  # fmt: skip

    def band_for(self, priority: bytes | None) -> int:
        """The band a request runs in: the tenant's, or a lower one its X-Priority asks for.
        A value that names no band is ignored."""
        if priority is None:
            return self.band
        asked = parse_band(priority.decode("latin-1"))
        return self.band if asked is None else min(asked, self.band)


#: The one tenant when slotgate has no keys: everything is shared as it is without tenants.
EVERYONE = Tenant("default")


def parse_band(text: str) -> int | None:
    """A band's name or number (0..9) as its number; None for anything else."""
    text = text.strip().lower()
    if text in BANDS:
        return BANDS[text]
    if text.isdigit() and len(text) <= 2 and int(text) <= MAX_BAND:
        return int(text)
    return None


def label(key: bytes) -> str:
    """The name of a key that has no other: `key-` and the first 8 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key).hexdigest()[:8]


def credentials(authorization: bytes | None, api_key: bytes | None) -> bytes | None:
    """The key a request presents: a Bearer token, else X-Api-Key."""
    presented = api_key
    if authorization is not None:
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() == b"bearer":
            presented = token.strip()
    return presented


class Roster:
    """The tenants and the key digests that identify them; never changed once built."""

    __slots__ = ("_digests", "_owners", "keyed", "source", "tenants")

    def __init__(self, owners: Iterable[tuple[bytes, Tenant]], source: Path | None = None) -> None:
        pairs = list(owners)
        self._digests = tuple(digest for digest, _ in pairs)
        #: Requests must present a key (an attribute, not a property: every request asks).
        self.keyed = bool(self._digests)
        self._owners = tuple(tenant for _, tenant in pairs)
        #: Every tenant once, in the order first named; (EVERYONE,) without keys.
        self.tenants = tuple({t.name: t for t in self._owners}.values()) or (EVERYONE,)
        self.source = source

    def identify(self, presented: bytes | None) -> Tenant | None:
        """The tenant whose key this is; None for no key or a wrong one (EVERYONE without keys).

        The presented key's SHA-256 is compared with every digest, in constant time each and
        without stopping at a match, so the time taken says nothing about which key (if any)
        matched, nor how much of one did.
        """
        if not self._digests:
            return EVERYONE
        if presented is None:
            return None
        digest = hashlib.sha256(presented).digest()
        found = 0
        for number, known in enumerate(self._digests, 1):
            # Digests are unique, so at most one term is not 0 and `|` gives its number.
            found |= number * hmac.compare_digest(digest, known)
        return self._owners[found - 1] if found else None


def roster(api_keys: Iterable[str] = (), path: Path | None = None) -> Roster:
    """The tenants of `path` (an API_KEYS_FILE), and each key of `api_keys` not in it as its
    own tenant. Raises InvalidTenantsFile."""
    owners: dict[bytes, Tenant] = {} if path is None else _read(path)
    for key in api_keys:
        raw = key.encode()
        owners.setdefault(hashlib.sha256(raw).digest(), Tenant(label(raw)))
    return Roster(owners.items(), path)


def _read(path: Path) -> dict[bytes, Tenant]:
    where = f"API_KEYS_FILE {path}"
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise InvalidTenantsFile(f"{where} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidTenantsFile(f"{where} is not valid TOML: {exc}") from None
    unknown = sorted(set(document) - {"tenants"})
    if unknown:
        raise InvalidTenantsFile(
            f"{where}: unknown top-level key {unknown[0]!r}; the file holds [tenants.NAME] tables"
        )
    tables = document.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise InvalidTenantsFile(f"{where}: no [tenants.NAME] table; add one per tenant")
    owners: dict[bytes, Tenant] = {}
    named: dict[bytes, str] = {}
    for name, table in tables.items():
        tenant, digests = _tenant(where, name, table)
        for digest in digests:
            if digest in named:
                raise InvalidTenantsFile(
                    f"{where}: tenant {name!r}: key: the same key as tenant {named[digest]!r}"
                )
            named[digest] = name
            owners[digest] = tenant
    return owners


def _tenant(where: str, name: str, table: object) -> tuple[Tenant, list[bytes]]:
    def fail(field: str, message: str) -> InvalidTenantsFile:
        return InvalidTenantsFile(f"{where}: tenant {name!r}: {field}: {message}")

    if not _NAME.fullmatch(name):
        raise InvalidTenantsFile(
            f"{where}: tenant {name!r}: name: use 1 to 64 letters, digits, '.', '_' or '-'"
        )
    if name == EVERYONE.name:
        raise InvalidTenantsFile(
            f"{where}: tenant {name!r}: name: {name!r} is slotgate's own, for no key; use another"
        )
    if not isinstance(table, dict):
        raise fail("table", "must be a table of fields, [tenants.NAME]")
    for field in table:
        if field not in _FIELDS:
            raise fail(field, f"unknown field; accepted: {', '.join(_FIELDS)}")
    digests: list[bytes] = []
    for field in ("key", "keys"):
        for key in _strings(table, field, fail):
            if not key:
                raise fail(field, "is empty")
            digests.append(hashlib.sha256(key.encode()).digest())
    for text in _strings(table, "sha256", fail):
        if not _SHA256.fullmatch(text.lower()):
            raise fail("sha256", "must be 64 hex digits, the SHA-256 of the key")
        digests.append(bytes.fromhex(text))
    if not digests:
        raise fail("key", "none given; set key, keys or sha256")
    weight = table.get("weight", 1)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or not 0 < weight <= 1_000_000
    ):
        raise fail("weight", "must be a positive number up to 1000000")
    band = table.get("band", "interactive")
    number = parse_band(band) if isinstance(band, str) else None
    if isinstance(band, int) and not isinstance(band, bool) and 0 <= band <= MAX_BAND:
        number = band
    if number is None:
        raise fail("band", f"must be interactive, batch or a number from 0 to {MAX_BAND}")
    limits: dict[str, int | None] = {}
    for field, least in (("max_active", 1), ("max_queued", 0)):
        value = table.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise fail(field, f"must be a whole number of at least {least}")
        if value is not None and value < least:
            raise fail(field, f"must be a whole number of at least {least}")
        limits[field] = value
    for field in LIMITS:
        value = table.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT
        ):
            raise fail(field, f"must be a whole number from 1 to {MAX_LIMIT}")
        limits[field] = value
    quota = Quota(*(limits[field] for field in LIMITS)) if any(map(limits.get, LIMITS)) else None
    max_wait = table.get("max_wait_s")
    if max_wait is not None and (
        isinstance(max_wait, bool)
        or not isinstance(max_wait, int | float)
        or not 0 <= max_wait <= MAX_WAIT_S
    ):
        raise fail("max_wait_s", f"must be a number of seconds from 0 to {MAX_WAIT_S:.0f}")
    tenant = Tenant(
        name, float(weight), number, limits["max_active"], limits["max_queued"], quota,
        None if max_wait is None else float(max_wait),
    )  # fmt: skip
    return tenant, digests


def _strings(
    table: dict[str, object], field: str, fail: Callable[[str, str], InvalidTenantsFile]
) -> list[str]:
    value = table.get(field)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise fail(field, "must be a string or a list of strings")


class Tenants:
    """The roster in force: identifies requests, and reloads API_KEYS_FILE on SIGHUP.

    A reload swaps the whole roster in one assignment on the event loop, so a request sees
    either the old or the new one, never a mixture; a bad file is refused (logged, one line)
    and the old roster kept.
    """

    def __init__(self, api_keys: Iterable[str] = (), path: Path | None = None) -> None:
        self._api_keys = tuple(api_keys)
        self._path = path
        self.roster = roster(self._api_keys, path)
        #: Called with the new roster after each successful reload (the fair line's retune).
        self.listeners: list[Callable[[Roster], None]] = []
        #: SIGHUP's handler before ours, put back when we give it up (slotgate's command has one
        #: that says there is nothing to reload, so that SIGHUP never stops the process).
        self._hangup: Any = None

    @property
    def keyed(self) -> bool:
        return self.roster.keyed

    def identify(self, authorization: bytes | None, api_key: bytes | None) -> Tenant | None:
        """The tenant of a request's credentials; None when they are missing or wrong."""
        return self.roster.identify(credentials(authorization, api_key))

    def reload(self) -> bool:
        """Read API_KEYS_FILE again and put it in force; False (and the old one kept) when it
        is not usable."""
        if self._path is None:
            return False
        try:
            fresh = roster(self._api_keys, self._path)
        except InvalidTenantsFile as exc:
            log.error("%s; the tenants loaded before stay in force", exc)  # noqa: TRY400 - one line
            return False
        self.roster = fresh
        log.info("API_KEYS_FILE %s reloaded: %d tenants", self._path, len(fresh.tenants))
        for listener in self.listeners:
            listener(fresh)
        return True

    def install(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Reload on SIGHUP (for the app's lifespan); False where signals cannot be handled
        (not the main thread, or no API_KEYS_FILE to reload)."""
        if self._path is None:
            return False
        try:
            self._hangup = signal.getsignal(signal.SIGHUP)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        except (NotImplementedError, RuntimeError, ValueError):
            return False
        return True

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._path is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                # The loop leaves SIG_DFL behind, which would end the process on a SIGHUP.
                if loop.remove_signal_handler(signal.SIGHUP) and self._hangup is not None:
                    signal.signal(signal.SIGHUP, self._hangup)
