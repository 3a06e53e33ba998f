"""slotgate's configuration: one frozen object read from the environment and an optional .env."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import SplitResult, urlsplit

from dotenv import dotenv_values
from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from slotgate.errors import InvalidTenantsFile
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.tenants import roster

MIB = 1024 * 1024

#: Variables slotgate reads besides its Settings: the local engine's (--model, --demo).
ENGINE_VARIABLES = {
    "LLAMA_SERVER_BIN": (
        "llama-server binary for --model/--demo; unset = llama-server on PATH, else xllamacpp.",
        "unset",
    ),
    "SLOTGATE_CACHE_DIR": (
        "Where --demo keeps its model.",
        "$XDG_CACHE_HOME/slotgate, else ~/.cache/slotgate",
    ),
}

#: Variables renamed to carry their unit, by their old names. An old name is still read when
#: the new one is not set (anywhere), and start-up names it in a warning (see `renamed`).
RENAMED = {
    "QUEUE_TIMEOUT": "QUEUE_TIMEOUT_S",
    "STARTUP_WAIT": "STARTUP_WAIT_S",
    "KEEPALIVE_INTERVAL": "KEEPALIVE_INTERVAL_S",
    "STREAM_HEAD_AFTER": "STREAM_HEAD_AFTER_S",
    "PROPS_REFRESH_INTERVAL": "PROPS_REFRESH_INTERVAL_S",
    "UPSTREAM_STALL_TIMEOUT": "UPSTREAM_STALL_TIMEOUT_S",
    "DRAIN_TIMEOUT": "DRAIN_TIMEOUT_S",
    "REDIS_TIMEOUT": "REDIS_TIMEOUT_S",
    "REDIS_TTL": "REDIS_TTL_S",
}


class _OldNames(PydanticBaseSettingsSource):
    """The renamed variables under their old names, from the environment, else from the
    .env file; ranked below both, so that a new name set anywhere wins."""

    def __init__(self, settings_cls: type[BaseSettings], *sources: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        # An EnvSettingsSource (the .env one too) holds every variable it read, lower-cased.
        self._read = [
            source.env_vars for source in sources if isinstance(source, EnvSettingsSource)
        ]

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads them all at once

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for old, new in RENAMED.items():
            values = [value for read in self._read if (value := read.get(old.lower()))]
            if values:
                found[new.lower()] = values[0]
        return found


def _check_port(parts: SplitResult) -> None:
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError("must have a port from 0 to 65535, if any") from None


class Settings(BaseSettings):
    """Every knob slotgate has; the environment variable is the field name in upper case."""

    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        env_ignore_empty=True,
        extra="ignore",
        frozen=True,
        # nan passes no bound check ("nan <= 3600" is simply false): refuse it by name.
        allow_inf_nan=False,
    )

    llama_server_url: str = Field(
        "http://127.0.0.1:8080",
        description="llama-server's base URL (http or https), or several, comma-separated.",
    )
    routing: Literal["affinity", "least-loaded"] = Field(
        "affinity",
        description="With several upstreams: by prompt-cache affinity, then load; or load alone.",
    )
    routing_epsilon: float = Field(
        1.0,
        ge=0,
        le=100,
        description="Affinity yields once its upstream is loaded above (1 + this) x the average.",
    )
    llama_api_key: SecretStr | None = Field(
        None, description="Sent upstream as a Bearer token; replaces the client's credentials."
    )
    host: str = Field("127.0.0.1", description="Address slotgate listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port slotgate listens on.")
    queue_per_slot: int | None = Field(
        None,
        ge=0,
        description="Line depth per slot (default 16, floored at MIN_QUEUE); 0 = unbounded.",
    )
    max_queue: int | None = Field(
        None, ge=0, description="Fixed queue depth, overrides QUEUE_PER_SLOT; 0 = unbounded."
    )
    min_queue: int | None = Field(
        None,
        ge=0,
        description="Floor under QUEUE_PER_SLOT x slots (default 64 with the default multiplier).",
    )
    queue_timeout_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="Seconds a request may wait in the queue; 0 = indefinitely.",
    )
    startup_wait_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Seconds a request may wait in the queue while llama-server starts or restarts "
        "(its slot count unknown); 0 = answer 503 at once.",
    )
    model_swap_after_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="Seconds the oldest waiter of a model a full llama-server router does not "
        "run may wait before a busy model is emptied and swapped for it (docs/models.md).",
    )
    keepalive_interval_s: float = Field(
        5.0, ge=0, le=3600, description="Seconds between SSE comments to a waiting stream; 0 = off."
    )
    stream_head_after_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="Seconds a streamed request waits in the queue before it gets its 200 head and "
        "keep-alive comments (until then a refusal keeps its status); 0 = at once.",
    )
    props_refresh_interval_s: float = Field(
        10.0, gt=0, le=3600, description="Seconds between reads of llama-server's /props."
    )
    kv_budget_tokens: int | None = Field(
        None,
        ge=0,
        description="Tokens of KV cache shared by all slots (llama-server without -np, or "
        "--kv-unified): admit only what fits; 0 = off; unset = learned.",
    )
    admission_control: bool = Field(
        True, description="Off = plain pass-through proxy, no slots and no line."
    )
    api_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Comma-separated keys clients must present; unset = open."
    )
    api_keys_file: Path | None = Field(
        None,
        description="TOML file of tenants: per key a name, weight, band, max_active and "
        "max_queued; reloaded on SIGHUP; unset = each API_KEYS key is a tenant of weight 1.",
    )
    admin_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Comma-separated keys for the operator controls (/admin/...), apart from "
        "API_KEYS; unset = loopback clients only, and none while API_KEYS is set.",
    )
    preempt_after_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="A waiter of a higher band that waited this long may preempt a lower band's "
        "request that has sent its client nothing yet (it is sent again later); 0 = off.",
    )
    session_flows: int = Field(
        0,
        ge=0,
        le=1024,
        description="Agent sessions (x-claude-code-session-id, x-session-affinity, session-id) "
        "as flows of their own in the fair order, hashed into this many per tenant; 0 = off.",
    )
    metrics_tenants: int = Field(
        10,
        ge=0,
        le=10_000,
        description="With keys: the first this many tenants seen keep their name in the metrics' "
        "tenant label, later ones share `other`; 0 = no tenant label.",
    )
    status_watchers: int = Field(
        16,
        ge=0,
        le=10_000,
        description="Clients that may watch GET /admission/events (and the status page) at "
        "once; one more is answered 429 too_many_watchers; 0 = the stream is off.",
    )
    max_body_bytes: int = Field(
        32 * MIB, ge=1, le=2**31, description="Largest request body accepted, in bytes."
    )
    queue_body_bytes: int = Field(
        256 * MIB,
        ge=0,
        le=2**40,
        description="Total bytes of generation request bodies not yet admitted (being read, "
        "parsed or waiting in the queue); past it 429 queue_bytes_full; 0 = unbounded.",
    )
    upstream_stall_timeout_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description="Seconds llama-server may stay silent on a running request; 0 = forever.",
    )
    head_timeout_s: float = Field(
        10.0, ge=0, le=3600, description="Seconds a request head may take to arrive; 0 = forever."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="Seconds running streams may finish after SIGTERM."
    )
    stream_upstream: bool = Field(
        True,
        description="Ask llama-server for a stream even for non-streamed completions, so it "
        "notices a client that left; off = forward as sent.",
    )
    forward_conversation_id: bool = Field(
        False, description="Pass X-Conversation-Id upstream (llama.cpp then ignores client exits)."
    )
    redis_url: str | None = Field(
        None,
        description="Redis or Valkey (redis://, rediss://, unix://) through which several "
        "slotgate replicas share one line and each upstream's slots; unset = this process alone.",
    )
    redis_failure_mode: Literal["local", "reject"] = Field(
        "local",
        description="While Redis is away: local = gate alone on this replica's share of the slots "
        "and of the line; reject = answer 503.",
    )
    redis_fleet: str = Field(
        "default",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name of the line in Redis: the replicas in front of the same llama-servers "
        "share one.",
    )
    redis_timeout_s: float = Field(
        0.25,
        gt=0,
        le=10,
        description="Seconds a Redis call may take before this replica falls back "
        "(REDIS_FAILURE_MODE).",
    )
    redis_ttl_s: float = Field(
        3.0,
        ge=0.3,
        le=300,
        description="Seconds after which a silent replica's places go back to the others, and its "
        "slots 10 times this later (it beats every third of this).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        old_names = _OldNames(settings_cls, env_settings, dotenv_settings)
        return init_settings, env_settings, dotenv_settings, old_names, file_secret_settings

    @field_validator("llama_server_url")
    @classmethod
    def _http_urls(cls, value: str) -> str:
        urls = [url.strip() for url in value.split(",") if url.strip()]
        if not urls:
            raise ValueError("must be an http:// or https:// URL with a host")
        checked = [cls._http_url(url) for url in urls]
        if len(set(checked)) != len(checked):
            raise ValueError("names one URL twice")
        return ",".join(checked)

    @staticmethod
    def _http_url(value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("must not carry a query or a fragment")
        try:
            parts.hostname.encode("idna")  # as DNS and the Host header will take it
        except UnicodeError:
            raise ValueError(
                f"has a host name that cannot be looked up ({parts.hostname}: a label is empty "
                "or over 63 characters)"
            ) from None
        if parts.username is not None or parts.password is not None:
            # slotgate would not send them, and /admission and the logs show the URL.
            raise ValueError("must not carry user:password@; llama-server's key is LLAMA_API_KEY")
        _check_port(parts)
        return value.rstrip("/")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in {"redis", "rediss", "unix"}:
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("must name a host")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("must name the socket's path")
        _check_port(parts)
        return value

    @field_validator("host")
    @classmethod
    def _unbracketed(cls, value: str) -> str:
        # [::1] is how an IPv6 address is written in a URL; the socket wants ::1.
        return value[1:-1] if value.startswith("[") and value.endswith("]") else value

    @field_validator("api_keys", "admin_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @field_validator("admin_keys")
    @classmethod
    def _apart_from_api_keys(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if set(value) & set(info.data.get("api_keys", ())):
            # Its holders, every client among them, could pause, drain and cancel.
            raise ValueError(
                "a key is in API_KEYS too; an operator's key must be one no client holds"
            )
        return value

    @field_validator("api_keys_file")
    @classmethod
    def _tenants_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                roster(path=value)
            except InvalidTenantsFile as exc:
                # The message names the file already; describe() puts the variable first.
                raise ValueError(
                    str(exc).removeprefix(f"API_KEYS_FILE {value}").lstrip(": ")
                ) from None
        return value

    @field_validator("log_level", "log_format", "routing", "redis_failure_mode", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def llama_server_urls(self) -> tuple[str, ...]:
        """The upstreams' base URLs, in the order given."""
        return tuple(self.llama_server_url.split(","))

    @property
    def queue_policy(self) -> QueuePolicy:
        return QueuePolicy(self.max_queue, self.queue_per_slot, self.min_queue)


def export_engine_variables(env_file: Path | str = ".env") -> None:
    """Put the engine's variables from `env_file` into the environment, where the engine
    reads them; a variable already set in the environment wins, as for the settings."""
    for key, value in dotenv_values(env_file).items():
        if key.upper() in ENGINE_VARIABLES and value:
            os.environ.setdefault(key.upper(), value)


def _known() -> list[str]:
    return [name.upper() for name in Settings.model_fields] + list(ENGINE_VARIABLES) + list(RENAMED)


def _set(env_file: Path | str) -> tuple[set[str], set[str]]:
    """The variables set (not empty) in the environment, and in `env_file`, upper-cased."""
    environment = {key.upper() for key, value in os.environ.items() if value}
    in_file = {key.upper() for key, value in dotenv_values(env_file).items() if value}
    return environment, in_file


def renamed(env_file: Path | str = ".env") -> list[str]:
    """A warning for each variable set under its old name (see RENAMED), in the environment
    or in `env_file`, naming the new one."""
    environment, in_file = _set(env_file)
    said = []
    for old, new in RENAMED.items():
        if old not in environment | in_file:
            continue
        where = "the environment" if old in environment else str(env_file)
        if new in environment | in_file:
            said.append(
                f"{old} (in {where}) is ignored: {new}, its new name, is set too; remove {old}"
            )
        else:
            said.append(
                f"{old} (in {where}) is deprecated: rename it {new} (read as {new} meanwhile)"
            )
    return said


#: Names other programs commonly read from the environment that are also near misses of a
#: setting: set in the environment, they are taken as theirs; in a .env file, as a slip.
_OTHER_PROGRAMS_NAMES = frozenset({"LOGLEVEL", "LOGFORMAT"})
#: Below this many letters (underscores aside) a name one letter off a setting is as likely
#: another program's (POST, HOSTS) as a slip, so only the same letters count as a near miss.
_NEAR_MISS_LETTERS = 8


def near_miss(name: str) -> str | None:
    """The setting `name` was surely meant to be, when slotgate does not read it as it is:
    the same letters ignoring case and underscores (MAXQUEUE), or, for a name of 8 letters or
    more, one letter added, dropped, changed or two swapped (QUEUE_TIMOEUT). The environment
    holds many other programs' variables: a looser rule would stop slotgate for one of them."""
    upper = name.upper()
    known = _known()
    # LLAMA_ARG_* are llama-server's: compose hands the same file to both containers.
    if upper in known or upper.startswith("LLAMA_ARG_"):
        return None
    letters = upper.replace("_", "")
    for setting in known:
        theirs = setting.replace("_", "")
        if letters == theirs or (
            min(len(letters), len(theirs)) >= _NEAR_MISS_LETTERS and _one_edit(letters, theirs)
        ):
            return RENAMED.get(setting, setting)
    return None


def _one_edit(a: str, b: str) -> bool:
    """`a` and `b` differ by one letter added, dropped or changed, or two adjacent swapped."""
    if abs(len(a) - len(b)) > 1:
        return False
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    a, b = a[start:], b[start:]
    return (
        a[1:] == b[1:]  # changed (or both ended)
        or a[1:] == b  # dropped
        or a == b[1:]  # added
        or (len(a) == len(b) >= 2 and a[0] == b[1] and a[1] == b[0] and a[2:] == b[2:])
    )


def mistyped(env_file: Path | str = ".env") -> str | None:
    """The one line that stops start-up when the environment or `env_file` sets a near miss
    of a setting (see near_miss): slotgate would otherwise run without it, silently."""
    said = [
        (key, f"{key} is set in the environment")
        for key, value in os.environ.items()
        if value and key.upper() not in _OTHER_PROGRAMS_NAMES
    ]
    said += [
        (key, f"{env_file} sets {key}") for key, value in dotenv_values(env_file).items() if value
    ]
    for key, where in said:
        meant = near_miss(key)
        if meant is not None:
            return (
                f"slotgate: {where}, but slotgate reads {meant}: rename it "
                "(or unset it, if it is not meant for slotgate)"
            )
    return None


def misspelt(env_file: Path | str = ".env") -> list[str]:
    """A warning for each key of `env_file` that slotgate does not read but that is close
    to one it does (QUEUE_PER_SLOTZ), naming that one; other keys are someone else's. (A near
    miss stops start-up instead: see `mistyped`.)"""
    known = _known()
    unknown = [
        key for key in dotenv_values(env_file) if key.upper() not in known and not near_miss(key)
    ]
    return [
        f"{env_file} sets {key}, which slotgate does not read; did you mean {close}?"
        for key in unknown
        if not key.upper().startswith("LLAMA_ARG_")
        for close in difflib.get_close_matches(key.upper(), known, n=1, cutoff=0.8)
    ]


def describe(error: ValidationError, env_file: Path | str = ".env") -> str:
    """One line naming the variable, the value given (and `env_file` when it came from
    there rather than the environment) and what is accepted."""
    first = error.errors()[0]
    name = str(first["loc"][0]).upper() if first["loc"] else "configuration"
    environment, in_file = _set(env_file)
    old = {new: old for old, new in RENAMED.items()}.get(name)
    if old is not None and name not in environment | in_file and old in environment | in_file:
        name = old  # the value came under the old name: name the variable the user set
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f"={value!s}"
    if name in ("LLAMA_API_KEY", "API_KEYS", "ADMIN_KEYS") or (
        name in ("LLAMA_SERVER_URL", "REDIS_URL") and "@" in shown
    ):
        shown = ""  # a secret, or a URL that may carry one
    where = f" in {env_file}" if name in in_file and name not in environment else ""
    message = str(first["msg"]).removeprefix("Value error, ")  # pydantic's, for a ValueError
    return f"slotgate: invalid {name}{shown}{where}: {message}"
