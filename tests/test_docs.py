"""The documentation stays true: docs/configuration.md against Settings, links to real files."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest
from pydantic import AliasChoices, AliasPath
from slotgate.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

#: Variables slotgate reads outside Settings, each documented in the configuration page too:
#: the local engine's (--model, --demo), read from the environment by the engine itself.
READ_ELSEWHERE = frozenset({"LLAMA_SERVER_BIN", "SLOTGATE_CACHE_DIR"})
#: Variables the code reads that belong to the platform, not to slotgate.
NOT_SLOTGATES = frozenset({"XDG_CACHE_HOME"})

FENCE = re.compile(r"^ *```.*?^ *```", re.MULTILINE | re.DOTALL)
ROW = re.compile(r"^\|(.*)\|\s*$")
NAME = re.compile(r"^`([A-Z][A-Z0-9_]*)`$")


def prose(page: Path) -> str:
    """The page without its code blocks, each blanked line for line so numbers still match."""
    return FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), page.read_text())


def environment_name(name: str) -> str:
    """The variable Settings reads for field `name`, as pydantic-settings names it."""
    field = Settings.model_fields[name]
    alias = field.validation_alias or field.alias
    if isinstance(alias, AliasChoices | AliasPath):
        pytest.fail(f"teach this test the variable of {name}: its alias is {alias!r}")
    prefix = Settings.model_config.get("env_prefix", "")
    named = prefix + (alias or name)
    return named if Settings.model_config.get("case_sensitive") else named.upper()


def settings_variables() -> dict[str, str]:
    """Each variable Settings reads, with its field's name."""
    return {environment_name(name): name for name in Settings.model_fields}


def variable_rows(page: Path) -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of each row of the page's `variable | default | meaning`
    tables: the documented entries. A row must name one variable, in a code span."""
    rows: list[tuple[str, str, str]] = []
    in_table = False
    for number, line in enumerate(prose(page).splitlines(), 1):
        match = ROW.match(line)
        if match is None:
            in_table = False
            continue
        cells = [cell.strip() for cell in match.group(1).split("|")]
        if [cell.lower() for cell in cells] == ["variable", "default", "meaning"]:
            in_table = True
            continue
        if not in_table or set(cells[0]) <= {"-", ":"}:
            continue
        name = NAME.match(cells[0])
        assert name is not None, f"{page.name}:{number}: a row names one `VARIABLE`: {line}"
        assert len(cells) == 3, f"{page.name}:{number}: a row has 3 cells: {line}"
        assert cells[2], f"{page.name}:{number}: {name.group(1)} has no meaning"
        rows.append((name.group(1), cells[1], cells[2]))
    return rows


def test_the_configuration_page_documents_every_setting_exactly_once() -> None:
    documented = Counter(name for name, _, _ in variable_rows(CONFIGURATION))
    expected = set(settings_variables()) | READ_ELSEWHERE
    missing = sorted(expected - set(documented))
    unknown = sorted(set(documented) - expected)
    twice = sorted(name for name, count in documented.items() if count > 1)
    problems = [
        *([f"does not document {missing}"] if missing else []),
        *([f"documents {unknown}, which slotgate does not read"] if unknown else []),
        *([f"documents {twice} more than once"] if twice else []),
    ]
    assert not problems, "docs/configuration.md " + "; ".join(problems)


def shown(value: object) -> str:
    """A default as the pages write it."""
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@pytest.mark.parametrize("page", ["README.md", "docs/configuration.md"])
def test_every_documented_default_is_the_one_settings_has(page: str) -> None:
    fields = settings_variables()
    rows = [row for row in variable_rows(ROOT / page) if row[0] in fields]
    assert rows, f"{page} has no table of settings"
    for name, default, _ in rows:
        value = Settings.model_fields[fields[name]].default
        given = re.match(r"`([^`]*)`|unset", default)
        assert given is not None, f"{page}: {name}'s default should be `VALUE` or unset: {default}"
        said = given.group(1) if given.group(1) is not None else "unset"
        if isinstance(value, int | float) and not isinstance(value, bool):
            assert said != "unset", f"{page}: {name} defaults to {value}"
            assert float(said) == value, f"{page}: {name} defaults to {value}"
        else:
            assert said == shown(value), f"{page}: {name} defaults to {shown(value)}, not {said}"


def test_every_variable_the_code_reads_by_name_is_documented() -> None:
    read = set()
    for source in (ROOT / "app").rglob("*.py"):
        text = source.read_text()
        read |= set(re.findall(r"environ(?:\.get\(|\[)\s*[\"']([A-Z][A-Z0-9_]*)[\"']", text))
        read |= set(re.findall(r"getenv\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']", text))
    assert read, "the code reads no variable by name: is ROOT right?"
    undocumented = sorted(read - READ_ELSEWHERE - NOT_SLOTGATES - set(settings_variables()))
    assert not undocumented, (
        f"the code reads {undocumented} from the environment: document them in "
        "docs/configuration.md and add them to READ_ELSEWHERE"
    )


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", prose(page), re.M):
        base = slug(heading)
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(page))
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(page: Path) -> None:
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        where = (page.parent / unquote(path)).resolve() if path else page
        assert where.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
        assert where.is_relative_to(ROOT), f"{page.relative_to(ROOT)} links outside: {target}"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), (
                f"{page.relative_to(ROOT)} links to {target}: {where.name} has no such heading"
            )


def cells(row: str) -> list[str]:
    """A table row's cells; `\\|` is a pipe inside a cell."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_table_row_has_as_many_cells_as_its_header(page: Path) -> None:
    lines = prose(page).splitlines()
    width = 0
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            width = 0
        elif width == 0:
            width = len(cells(line))
            rule = lines[number] if number < len(lines) else ""
            assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rule.strip()), (
                f"{page.relative_to(ROOT)}:{number + 1}: a table's second line is its |---| rule"
            )
            assert len(cells(rule)) == width, f"{page.relative_to(ROOT)}:{number + 1}: rule width"
        else:
            assert len(cells(line)) == width, (
                f"{page.relative_to(ROOT)}:{number}: {len(cells(line))} cells, the header has "
                f"{width}: {line}"
            )


def test_the_readme_links_every_page_of_the_manual() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked)
    assert not unlinked, f"README.md does not link {unlinked}"


def test_the_readme_s_first_two_commands_run_the_demo_and_the_checks() -> None:
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert [block.strip() for block in blocks[:2]] == [
        "python3 -m venv .venv && .venv/bin/pip install '.[demo]' && .venv/bin/slotgate --demo",
        "scripts/check",
    ]


def test_the_readme_stays_a_front_door() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 260, f"README.md has {lines} lines: move the detail to a page in docs/"


DESIGN = ROOT / "docs" / "design.md"
#: A module path as docs/design.md names one: `gate/admission.py`, `cli.py`, `lua/enter.lua`.
MODULE = re.compile(r"`((?:[a-z_]+/)*[a-z_]+\.(?:py|lua))`")


def test_the_design_page_names_every_module_and_only_modules_that_exist() -> None:
    app = ROOT / "app"
    modules = {
        path.relative_to(app).as_posix()
        for pattern in ("*.py", "*.lua")
        for path in app.rglob(pattern)
        if not (path.name == "__init__.py" and len(ast.parse(path.read_text()).body) <= 1)
    }
    named = set(MODULE.findall(DESIGN.read_text()))
    assert sorted(modules - named) == [], "modules docs/design.md does not name"
    # Any other name is a module's own name (`relay.py` in the prose), or a file of the
    # tests, the bench or the scripts (`tests/support/standin.py`, `standin.py`).
    files = {
        path.relative_to(ROOT).as_posix()
        for top in ("tests", "bench", "scripts")
        for path in (ROOT / top).rglob("*")
    }
    known = modules | files

    def exists(name: str) -> bool:
        return name in known or any(path.endswith("/" + name) for path in known)

    assert [name for name in named if not exists(name)] == [], "files docs/design.md invents"
