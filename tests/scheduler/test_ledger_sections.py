"""queries.sql and the ledger are read side by side: the same sections, with the same titles, in
the same order, each holding the queries of its methods. `Ledger`'s bases are its sections, one
mixin module each under `lorafleet/ledger/sections/`, in queries.sql's order: a reader who finds
a method under "Leases (the worker stream)" finds its SQL under the same title."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from lorafleet.ledger import ledger as ledger_module
from lorafleet.ledger.ledger import Ledger

_SQL = Path(ledger_module.__file__).parent / "sql" / "queries.sql"
# A section title: `# Title ----` in a section's mixin, `-- Title ----` in queries.sql.
_PY_TITLE = re.compile(r"^    # (?P<title>[^-].*?) -{3,}$")
_SQL_TITLE = re.compile(r"^-- (?P<title>[^-].*?) -{3,}$")
_SQL_NAME = re.compile(r"^-- name: (?P<name>\w+)\s*$")


def sql_sections() -> list[tuple[str, list[str]]]:
    sections: list[tuple[str, list[str]]] = []
    for line in _SQL.read_text().splitlines():
        if title := _SQL_TITLE.match(line):
            sections.append((title["title"], []))
        elif name := _SQL_NAME.match(line):
            assert sections, f"query {name['name']} comes before the first section title"
            sections[-1][1].append(name["name"])
    return sections


def ledger_sections() -> list[tuple[str, list[str]]]:
    """Each titled section of the Ledger (its bases, in order) with the queries its methods run."""
    sections: list[tuple[str, list[str]]] = []
    for base in Ledger.__bases__:
        source = Path(inspect.getfile(base)).read_text()
        lines = source.splitlines()
        titles = [
            (i + 1, m["title"]) for i, line in enumerate(lines) if (m := _PY_TITLE.match(line))
        ]
        assert len(titles) == 1, f"{base.__name__} holds {len(titles)} sections, not one"
        (at, title), queries = titles[0], []
        mixin = next(
            n
            for n in ast.parse(source).body
            if isinstance(n, ast.ClassDef) and n.name == base.__name__
        )
        for method in mixin.body:
            if not isinstance(method, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            for node in ast.walk(method):
                name = _query_name(node)
                if name is None:
                    continue
                assert at < method.lineno, f"{method.name} runs {name} before its section title"
                if name not in queries:
                    queries.append(name)
        sections.append((title, queries))
    return sections


def _query_name(node: ast.AST) -> str | None:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("_fetch", "_fetchrow")
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        return str(node.args[0].value)
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "QUERIES"
        and isinstance(node.slice, ast.Constant)
    ):
        return str(node.slice.value)
    return None


def test_the_sections_have_the_same_titles_in_the_same_order() -> None:
    assert [title for title, _ in sql_sections()] == [title for title, _ in ledger_sections()]


def test_each_query_sits_in_the_section_of_the_method_that_runs_it() -> None:
    in_sql = {name: title for title, names in sql_sections() for name in names}
    in_py = {name: title for title, names in ledger_sections() for name in names}
    misplaced = {
        name: (in_sql.get(name), title)
        for name, title in in_py.items()
        if in_sql.get(name) != title
    }
    assert not misplaced, "query: (its section in queries.sql, its method's in the Ledger)"


# A query with this many positional parameters or more says what each one is.
_MANY_PARAMETERS = 4


def test_each_parameter_of_a_query_with_many_is_named_in_its_comment() -> None:
    """asyncpg binds `$1..$n` by position: with four or more, the query's comment names each
    (`$3 the result key`), so that a reader checks a call's arguments against it without
    counting."""
    unnamed = {}
    blocks = re.split(r"^-- name: (\w+)\n", _SQL.read_text(), flags=re.M)
    for name, body in zip(blocks[1::2], blocks[2::2], strict=True):
        lines = body.split("\n\n")[0].splitlines()
        comment = "\n".join(line for line in lines if line.startswith("--"))
        sql = "\n".join(line.split("--")[0] for line in lines if not line.startswith("--"))
        parameters = {int(n) for n in re.findall(r"\$(\d+)", sql)}
        if len(parameters) < _MANY_PARAMETERS:
            continue
        named = {int(n) for n in re.findall(r"\$(\d+)\b", comment)}
        if missing := sorted(parameters - named):
            unnamed[name] = missing
    assert not unnamed, f"parameters no comment names: {unnamed}"
