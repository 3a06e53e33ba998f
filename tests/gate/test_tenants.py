"""Tenants: API_KEYS and API_KEYS_FILE, identifying a request's key, X-Priority, reloads."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from pathlib import Path

import pytest
from slotgate.errors import InvalidTenantsFile
from slotgate.gate.tenants import BATCH, EVERYONE, INTERACTIVE, Tenant, Tenants, roster

from tests.conftest import write_keys

FILE = """
[tenants.chat]
key = "sk-chat"
weight = 3
max_active = 2

[tenants.jobs]
keys = ["sk-jobs-1", "sk-jobs-2"]
band = "batch"
max_queued = 100

[tenants.ops]
sha256 = "{ops_digest}"
band = 5
weight = 0.5
"""


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return write_keys(tmp_path, FILE.format(ops_digest=hashlib.sha256(b"sk-ops").hexdigest()))


def test_without_keys_everyone_is_one_tenant_and_needs_no_key() -> None:
    tenants = Tenants()
    assert not tenants.keyed
    assert tenants.roster.tenants == (EVERYONE,)
    assert tenants.identify(None, None) is EVERYONE
    assert tenants.identify(b"Bearer anything", None) is EVERYONE


def test_each_api_key_is_its_own_tenant_named_by_a_label_not_the_key() -> None:
    tenants = Tenants(("sk-alpha", "sk-beta"))
    alpha = tenants.identify(b"Bearer sk-alpha", None)
    beta = tenants.identify(None, b"sk-beta")
    assert alpha == Tenant("key-" + hashlib.sha256(b"sk-alpha").hexdigest()[:8])
    assert beta is not None
    assert beta.name != alpha.name
    assert (beta.weight, beta.band) == (1.0, INTERACTIVE)
    assert "alpha" not in alpha.name


@pytest.mark.parametrize(
    ("authorization", "api_key", "name"),
    [
        (b"Bearer sk-chat", None, "chat"),
        (b"bearer  sk-jobs-2 ", None, "jobs"),
        (None, b"sk-jobs-1", "jobs"),
        (None, b"sk-ops", "ops"),  # known to the file by its SHA-256 only
        (b"Bearer sk-plain", None, "key-" + hashlib.sha256(b"sk-plain").hexdigest()[:8]),
        (b"Bearer sk-chat", b"sk-jobs-1", "chat"),  # the Bearer token wins, as in access.py
        (b"Bearer sk-cha", None, None),
        (b"Bearer sk-chat2", None, None),
        (b"Basic sk-chat", None, None),
        (None, None, None),
    ],
)
def test_a_key_is_identified_as_its_tenant(
    keys_file: Path, authorization: bytes | None, api_key: bytes | None, name: str | None
) -> None:
    tenants = Tenants(("sk-plain",), keys_file)
    found = tenants.identify(authorization, api_key)
    assert (found.name if found is not None else None) == name


def test_the_file_gives_each_tenant_its_weight_band_and_limits(keys_file: Path) -> None:
    by_name = {t.name: t for t in roster(path=keys_file).tenants}
    assert by_name == {
        "chat": Tenant("chat", 3.0, INTERACTIVE, max_active=2),
        "jobs": Tenant("jobs", 1.0, BATCH, max_queued=100),
        "ops": Tenant("ops", 0.5, 5),
    }


def test_a_key_in_both_api_keys_and_the_file_is_the_files_tenant(keys_file: Path) -> None:
    tenants = Tenants(("sk-chat",), keys_file)
    assert [t.name for t in tenants.roster.tenants] == ["chat", "jobs", "ops"]


@pytest.mark.parametrize(
    ("priority", "own", "band"),
    [
        (None, INTERACTIVE, INTERACTIVE),
        (b"batch", INTERACTIVE, BATCH),
        (b" Batch ", INTERACTIVE, BATCH),
        (b"0", 5, 0),
        (b"3", 5, 3),
        (b"interactive", BATCH, BATCH),  # never raised
        (b"9", INTERACTIVE, INTERACTIVE),
        (b"urgent", INTERACTIVE, INTERACTIVE),  # names no band: ignored
        (b"-1", INTERACTIVE, INTERACTIVE),
        (b"10", 5, 5),
    ],
)
def test_x_priority_may_lower_a_requests_band_but_never_raise_it(
    priority: bytes | None, own: int, band: int
) -> None:
    assert Tenant("t", band=own).band_for(priority) == band


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tenants.a]\nkey = "k"\nweight = 0\n', "tenant 'a': weight: must be a positive number"),
        ('[tenants.a]\nkey = "k"\nweight = "3"\n', "tenant 'a': weight: must be a positive"),
        ('[tenants.a]\nkey = "k"\nband = "urgent"\n', "tenant 'a': band: must be interactive,"),
        ('[tenants.a]\nkey = "k"\nband = 10\n', "tenant 'a': band: must be interactive, batch"),
        ('[tenants.a]\nkey = "k"\nmax_active = 0\n', "tenant 'a': max_active: must be a whole"),
        ('[tenants.a]\nkey = "k"\nmax_queued = 1.5\n', "tenant 'a': max_queued: must be a whole"),
        ('[tenants.a]\nkey = "k"\nmax_active = true\n', "tenant 'a': max_active: must be a"),
        ('[tenants.a]\nkey = "k"\nwieght = 2\n', "tenant 'a': wieght: unknown field; accepted"),
        ("[tenants.a]\nweight = 2\n", "tenant 'a': key: none given; set key, keys or sha256"),
        ('[tenants.a]\nkey = ""\n', "tenant 'a': key: is empty"),
        ("[tenants.a]\nkeys = [1]\n", "tenant 'a': keys: must be a string or a list"),
        ('[tenants.a]\nsha256 = "abc"\n', "tenant 'a': sha256: must be 64 hex digits"),
        ('[tenants.a]\nkey = "k"\n[tenants.b]\nkey = "k"\n', "tenant 'b': key: the same key as"),
        ('[tenants."a b"]\nkey = "k"\n', "tenant 'a b': name: use 1 to 64 letters"),
        ('[tenants.default]\nkey = "k"\n', "tenant 'default': name: 'default' is slotgate's"),
        # Past what the fleet's Redis script counts exactly (its numbers are doubles).
        (
            '[tenants.a]\nkey = "k"\ntokens_per_day = 100000000000000\n',
            "tenant 'a': tokens_per_day: must be a whole number from 1 to 1000000000000",
        ),
        ('[tenants.a]\nkey = "k"\nrequests_per_minute = 0\n', "requests_per_minute: must be"),
        ('[tenants.a]\nkey = "k"\ntokens_per_minute = 1.5\n', "tokens_per_minute: must be"),
        ('[tenants.a]\nkey = "k"\ntokens_per_minute = "9"\n', "tokens_per_minute: must be"),
        ('[tenant.a]\nkey = "k"\n', "unknown top-level key 'tenant'"),
        ("", "no [tenants.NAME] table"),
        ("[tenants.a\n", "is not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_the_file_tenant_and_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write_keys(tmp_path, text)
    with pytest.raises(InvalidTenantsFile) as caught:
        roster(path=path)
    line = str(caught.value)
    assert line.startswith(f"API_KEYS_FILE {path}")
    assert message in line
    assert "\n" not in line
    assert '"k"' not in line  # never the key itself


def test_a_reload_puts_the_new_file_in_force_and_old_tenants_stay_whole(
    tmp_path: Path,
) -> None:
    path = write_keys(tmp_path, '[tenants.chat]\nkey = "sk-chat"\nweight = 3\n')
    tenants = Tenants((), path)
    heard: list[tuple[str, ...]] = []
    tenants.listeners.append(lambda fresh: heard.append(tuple(t.name for t in fresh.tenants)))
    in_flight = tenants.identify(b"Bearer sk-chat", None)
    write_keys(
        tmp_path, '[tenants.chat]\nkey = "sk-chat"\nweight = 5\n[tenants.new]\nkey = "sk-new"\n'
    )
    assert tenants.reload()
    assert in_flight == Tenant("chat", weight=3)
    assert tenants.identify(b"Bearer sk-chat", None) == Tenant("chat", weight=5)
    assert tenants.identify(b"Bearer sk-new", None) == Tenant("new")
    assert heard == [("chat", "new")]


def test_a_bad_reload_is_refused_logged_and_the_old_tenants_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_keys(tmp_path, '[tenants.chat]\nkey = "sk-chat"\n')
    tenants = Tenants((), path)
    before = tenants.roster
    write_keys(tmp_path, '[tenants.chat]\nkey = "sk-chat"\nmax_active = -2\n')
    with caplog.at_level(logging.INFO, logger="slotgate"):
        assert not tenants.reload()
    assert tenants.roster is before
    assert tenants.identify(b"Bearer sk-chat", None) == Tenant("chat")
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert f"API_KEYS_FILE {path}: tenant 'chat': max_active:" in record.getMessage()


async def test_sighup_reloads_the_file(tmp_path: Path) -> None:
    path = write_keys(tmp_path, '[tenants.chat]\nkey = "sk-chat"\n')
    tenants = Tenants((), path)
    loop = asyncio.get_running_loop()
    assert tenants.install(loop)
    try:
        write_keys(tmp_path, '[tenants.chat]\nkey = "sk-chat"\nband = "batch"\n')
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if tenants.roster.tenants[0].band == BATCH:
                break
        assert tenants.roster.tenants == (Tenant("chat", band=BATCH),)
    finally:
        tenants.uninstall(loop)


async def test_without_a_file_there_is_nothing_to_reload() -> None:
    tenants = Tenants(("sk-a",))
    assert not tenants.reload()
    assert not tenants.install(asyncio.get_running_loop())
