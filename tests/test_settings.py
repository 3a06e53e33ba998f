"""Configuration: defaults, parsing, and one clear line for every bad value."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from slotgate.settings import RENAMED, Settings, describe, misspelt, mistyped, near_miss, renamed


@pytest.fixture
def env(tmp_path: Path) -> Path:
    """Where the test's .env file goes; not written yet."""
    return tmp_path / ".env"


def test_defaults_match_the_documented_ones() -> None:
    settings = Settings(_env_file=None)
    assert settings.llama_server_url == "http://127.0.0.1:8080"
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.queue_policy.limit(2) == 64
    assert settings.queue_timeout_s == 0
    assert settings.keepalive_interval_s == 5
    assert settings.props_refresh_interval_s == 10
    assert settings.admission_control is True
    assert settings.api_keys == ()
    assert settings.max_body_bytes == 32 * 1024 * 1024


def test_environment_and_dotenv_are_read(monkeypatch: pytest.MonkeyPatch, env: Path) -> None:
    env.write_text("MAX_QUEUE=7\nAPI_KEYS= a, b ,,\nLLAMA_SERVER_URL=http://llama:8080/\n")
    monkeypatch.setenv("QUEUE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("LOG_LEVEL", "DEBUG")
    settings = Settings(_env_file=env)
    assert settings.max_queue == 7
    assert settings.api_keys == ("a", "b")
    assert settings.llama_server_url == "http://llama:8080"
    assert settings.queue_timeout_s == 2.5
    assert settings.log_level == "debug"


def test_empty_values_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_QUEUE", "")
    assert Settings(_env_file=None).max_queue is None


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("MAX_QUEUE", "-1", "MAX_QUEUE=-1"),
        ("QUEUE_PER_SLOT", "lots", "QUEUE_PER_SLOT=lots"),
        ("MIN_QUEUE", "-5", "MIN_QUEUE=-5"),
        ("PORT", "70000", "PORT=70000"),
        ("QUEUE_TIMEOUT_S", "-1", "QUEUE_TIMEOUT_S=-1"),
        ("KEEPALIVE_INTERVAL_S", "soon", "KEEPALIVE_INTERVAL_S=soon"),
        ("PROPS_REFRESH_INTERVAL_S", "0", "PROPS_REFRESH_INTERVAL_S=0"),
        ("ADMISSION_CONTROL", "maybe", "ADMISSION_CONTROL=maybe"),
        ("MAX_BODY_BYTES", "0", "MAX_BODY_BYTES=0"),
        ("LLAMA_SERVER_URL", "localhost:8080", "LLAMA_SERVER_URL=localhost:8080"),
        ("LLAMA_SERVER_URL", "ftp://host", "http:// or https://"),
        ("LLAMA_SERVER_URL", "http://127.0.0.1:99999", "port from 0 to 65535"),
        ("LLAMA_SERVER_URL", "http://llama:abc", "port from 0 to 65535"),
        ("LLAMA_SERVER_URL", "http://llama:8080?x=1", "query"),
        ("LOG_LEVEL", "loud", "LOG_LEVEL=loud"),
        ("LOG_FORMAT", "xml", "LOG_FORMAT=xml"),
        ("DRAIN_TIMEOUT_S", "1e9", "DRAIN_TIMEOUT_S"),
        ("DRAIN_TIMEOUT_S", "nan", "DRAIN_TIMEOUT_S=nan: Input should be a finite number"),
        ("QUEUE_TIMEOUT_S", "inf", "QUEUE_TIMEOUT_S=inf: Input should be a finite number"),
        ("UPSTREAM_STALL_TIMEOUT_S", "-inf", "finite number"),
        ("KEEPALIVE_INTERVAL_S", "NaN", "finite number"),
    ],
)
def test_a_bad_value_is_described_in_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, says: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    line = describe(caught.value)
    assert "\n" not in line
    assert line.startswith(f"slotgate: invalid {name}")
    assert says in line


def test_secrets_are_not_echoed_in_the_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_API_KEY", "x" * 3)
    monkeypatch.setenv("PORT", "-1")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    assert "xxx" not in describe(caught.value)


def test_a_url_with_credentials_is_refused_without_echoing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLAMA_SERVER_URL", "http://user:hunter2@llama:8080")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    line = describe(caught.value)
    assert line.startswith("slotgate: invalid LLAMA_SERVER_URL")
    assert "LLAMA_API_KEY" in line
    assert "hunter2" not in line


def test_dotenv_keys_close_to_a_setting_are_named_with_the_setting(
    env: Path,
) -> None:
    env.write_text(
        "QUEUES_PER_SLOTS=4\nmaxqueue=3\nLLAMA_SERVER_BINARY=x\nMAX_QUEUE=2\n"
        "LLAMA_ARG_API_KEY=k\nCOMPOSE_FILE=docker/compose.yaml\nSLOTGATE_PORT=8000\n"
    )
    assert misspelt(env) == [
        f"{env} sets QUEUES_PER_SLOTS, which slotgate does not read; did you mean QUEUE_PER_SLOT?",
        f"{env} sets LLAMA_SERVER_BINARY, which slotgate does not read; "
        "did you mean LLAMA_SERVER_BIN?",
    ]  # maxqueue is a near miss: it stops start-up instead (mistyped)


def test_no_dotenv_is_nothing_to_warn_about(env: Path) -> None:
    assert misspelt(env) == []


def test_a_bad_value_from_dotenv_names_the_file_and_a_refused_url_says_why_plainly(
    monkeypatch: pytest.MonkeyPatch, env: Path
) -> None:
    env.write_text("LLAMA_SERVER_URL=ftp://llama\n")
    monkeypatch.delenv("LLAMA_SERVER_URL", raising=False)
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=env)
    assert describe(caught.value, env) == (
        f"slotgate: invalid LLAMA_SERVER_URL=ftp://llama in {env}: "
        "must be an http:// or https:// URL with a host"
    )


def test_a_bad_value_from_the_environment_is_not_blamed_on_dotenv(
    monkeypatch: pytest.MonkeyPatch, env: Path
) -> None:
    env.write_text("PORT=8001\n")
    monkeypatch.setenv("PORT", "abc")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=env)
    assert describe(caught.value, env).startswith("slotgate: invalid PORT=abc: ")


def test_an_ipv6_host_may_be_written_in_brackets_as_in_a_url() -> None:
    assert Settings(_env_file=None, host="[::1]").host == "::1"
    assert Settings(_env_file=None, host="::1").host == "::1"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("http://valkey:6379", "must be a redis://, rediss:// or unix:// URL"),
        ("redis://", "must name a host"),
        ("redis://valkey:99999", "must have a port from 0 to 65535"),
        ("unix://", "must name the socket's path"),
    ],
)
def test_a_redis_url_that_is_not_one_stops_start_up_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    monkeypatch.setenv("REDIS_URL", value)
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    line = describe(caught.value)
    assert line.startswith("slotgate: invalid REDIS_URL")
    assert why in line


def test_a_refused_redis_url_never_echoes_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "http://:hunter2@valkey:6379")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    line = describe(caught.value)
    assert line.startswith("slotgate: invalid REDIS_URL")
    assert "hunter2" not in line


def test_redis_settings_accept_the_urls_valkey_takes_and_refuse_a_fleet_name_with_braces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for url in ("redis://valkey:6379/0", "rediss://:pw@cache.example:6380", "unix:///run/v.sock"):
        assert Settings(_env_file=None, redis_url=url).redis_url == url
    monkeypatch.setenv("REDIS_FLEET", "a}b")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    assert describe(caught.value).startswith("slotgate: invalid REDIS_FLEET=a}b")
    monkeypatch.setenv("REDIS_FLEET", "chat-prod")
    monkeypatch.setenv("REDIS_FAILURE_MODE", "REJECT")
    settings = Settings(_env_file=None)
    assert (settings.redis_fleet, settings.redis_failure_mode) == ("chat-prod", "reject")


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("MAXQUEUE", "MAX_QUEUE"),
        ("max_queu", None),  # too short a name for a letter off to be sure
        ("Queue_Per_Slots", "QUEUE_PER_SLOT"),
        ("QUEUE_TIMOEUT", "QUEUE_TIMEOUT_S"),
        ("LLAMASERVERURL", "LLAMA_SERVER_URL"),
        ("KV_BUDGET_TOKEN", "KV_BUDGET_TOKENS"),
        ("MAX_QUEUE", None),  # read as it is
        ("max_queue", None),  # read too: names are not case-sensitive
        ("HOSTNAME", None),
        ("POST", None),
        ("LLAMA_ARG_N_PARALLEL", None),  # llama-server's
        ("REDIS_PASSWORD", None),
    ],
)
def test_a_name_is_a_near_miss_only_when_a_setting_was_surely_meant(
    name: str, meant: str | None
) -> None:
    assert near_miss(name) == meant


def test_a_misspelt_setting_in_the_environment_or_dotenv_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, env: Path
) -> None:
    monkeypatch.setenv("MAXQUEUE", "2")
    assert mistyped(env) == (
        "slotgate: MAXQUEUE is set in the environment, but slotgate reads MAX_QUEUE: rename it "
        "(or unset it, if it is not meant for slotgate)"
    )
    monkeypatch.delenv("MAXQUEUE")
    monkeypatch.setenv("MAXQUEUE", "")  # empty: read as unset, as the settings are
    assert mistyped(env) is None
    env.write_text("QUEUETIMEOUT=5\n")
    assert mistyped(env) == (
        f"slotgate: {env} sets QUEUETIMEOUT, but slotgate reads QUEUE_TIMEOUT_S: rename it "
        "(or unset it, if it is not meant for slotgate)"
    )


def test_loglevel_in_the_environment_is_left_to_the_programs_that_read_it_but_not_in_dotenv(
    monkeypatch: pytest.MonkeyPatch, env: Path
) -> None:
    # Many images and tools read LOGLEVEL from the environment: it must not stop slotgate.
    monkeypatch.setenv("LOGLEVEL", "debug")
    assert mistyped(env) is None
    env.write_text("LOGLEVEL=debug\n")
    assert mistyped(env) == (
        f"slotgate: {env} sets LOGLEVEL, but slotgate reads LOG_LEVEL: rename it "
        "(or unset it, if it is not meant for slotgate)"
    )


@pytest.mark.parametrize(("old", "new"), RENAMED.items())
def test_a_renamed_setting_is_still_read_under_its_old_name_and_warned_about(
    monkeypatch: pytest.MonkeyPatch, env: Path, old: str, new: str
) -> None:
    monkeypatch.setenv(old, "7")
    assert getattr(Settings(_env_file=env), new.lower()) == 7
    assert near_miss(old) is None  # a name slotgate reads, not a slip
    assert mistyped(env) is None
    assert renamed(env) == [
        f"{old} (in the environment) is deprecated: rename it {new} (read as {new} meanwhile)"
    ]


def test_a_renamed_setting_under_its_new_name_wins_wherever_either_is_set(
    monkeypatch: pytest.MonkeyPatch, env: Path
) -> None:
    env.write_text("QUEUE_TIMEOUT_S=2\nREDIS_TTL=4\n")
    monkeypatch.setenv("QUEUE_TIMEOUT", "9")
    settings = Settings(_env_file=env)
    assert settings.queue_timeout_s == 2
    assert settings.redis_ttl_s == 4  # from .env, under its old name
    assert renamed(env) == [
        "QUEUE_TIMEOUT (in the environment) is ignored: QUEUE_TIMEOUT_S, its new name, is set "
        "too; remove QUEUE_TIMEOUT",
        f"REDIS_TTL (in {env}) is deprecated: rename it REDIS_TTL_S (read as REDIS_TTL_S "
        "meanwhile)",
    ]
    assert misspelt(env) == []


def test_a_bad_value_under_an_old_name_names_the_variable_as_it_was_set(
    monkeypatch: pytest.MonkeyPatch, env: Path
) -> None:
    env.write_text("STARTUP_WAIT=-1\n")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=env)
    assert describe(caught.value, env) == (
        f"slotgate: invalid STARTUP_WAIT=-1 in {env}: Input should be greater than or equal to 0"
    )


def test_a_near_miss_of_an_old_name_points_at_the_new_one() -> None:
    assert near_miss("DRAINTIMEOUT") == "DRAIN_TIMEOUT_S"


def test_a_key_in_both_api_keys_and_admin_keys_stops_start_up_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every client holding that API key could pause, drain and cancel.
    monkeypatch.setenv("API_KEYS", "client-key,shared-s3cret")
    monkeypatch.setenv("ADMIN_KEYS", "ops-key, shared-s3cret")
    with pytest.raises(ValidationError) as caught:
        Settings(_env_file=None)
    line = describe(caught.value)
    assert line.startswith("slotgate: invalid ADMIN_KEYS: ")
    assert "API_KEYS" in line.removeprefix("slotgate: invalid ADMIN_KEYS")
    assert "s3cret" not in line
    assert "ops-key" not in line
    monkeypatch.setenv("ADMIN_KEYS", "ops-key")
    assert Settings(_env_file=None).admin_keys == ("ops-key",)
