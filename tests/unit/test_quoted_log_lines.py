"""The log lines the user docs quote are lines the code prints today: each `collabopt: ...` line quoted in
docs/troubleshooting.md and docs/options.md, and each line of troubleshooting's log excerpts, is found among the
string literals of collabopt or of the hivemind it runs on (a hivemind line's ``[module.function:line]`` at that
line of that module). A message reworded in the code fails here until the page says what a user now sees."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import hivemind
import pytest

ROOT = Path(__file__).resolve().parents[2]
HIVEMIND = Path(hivemind.__file__).parent
PAGES = ("troubleshooting.md", "options.md")
HOLE = "\x00"  # where a literal takes a value (a %-format, an f-string's field)
# what a quote shows in place of a value: numbers, peer ids, <error>, (...), ..., N, {}
VALUE = re.compile(r"12D3KooW\S*|<[^>]*>|\(\.\.\.\)|\.\.\.|\{\}|\bN\b|\d+(?:\.\d+)?")
# hivemind's format: [LEVEL] [module.function:line] message (its logging names WARNING "WARN")
HIVEMIND_LINE = re.compile(r"^\[(?:DEBUG|INFO|WARN|ERROR)\] \[([\w.]+)\.(\w+):(\d+)\] (.*)$")


def _literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = re.sub(r"%[-+ #0]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]", HOLE, node.value.replace("%%", "\x01"))
        text = text.replace("\x01", "%")
        return " ".join(text.split())
    if isinstance(node, ast.JoinedStr):
        return " ".join("".join(part.value if isinstance(part, ast.Constant) else HOLE
                                for part in node.values).split())
    return None


@functools.cache
def literals(path: Path) -> tuple[str, ...]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return tuple(text for node in ast.walk(tree) if (text := _literal(node)))


@functools.cache
def all_literals() -> tuple[str, ...]:
    files = [*(ROOT / "collabopt").rglob("*.py"), *(ROOT / "integrations").glob("*.py"), *HIVEMIND.rglob("*.py")]
    return tuple(text for path in files for text in literals(path))


@functools.cache
def patterns(candidates: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    """The literals with values as patterns, each hole any text; those with at least 12 characters of their own
    besides "collabopt: " (a bare f"collabopt: {e}" would match any quote)."""
    own = [text for text in candidates if len(text.replace(HOLE, "").replace("collabopt: ", "")) >= 12]
    return tuple(re.compile(".+?".join(map(re.escape, text.split(HOLE)))) for text in own if HOLE in text)


def printed_by(quote: str, candidates: tuple[str, ...]) -> bool:
    """Whether one literal holds the quote's text, its values left out, in order; or one literal with values,
    those filled in, is the quote (a message whose value is another message, an exception's text)."""
    quote = " ".join(quote.split())
    fragments = [part for part in VALUE.split(quote) if part.strip(" .,:;()")]
    for text in candidates:
        at = 0
        for fragment in fragments:
            at = text.find(fragment, at)
            if at < 0:
                break
            at += len(fragment)
        else:
            return True
    return any(pattern.fullmatch(quote) for pattern in patterns(candidates))


def quotes() -> list[tuple[str, str]]:
    """(page, quoted line): the `collabopt: ...` and `DiLoCo round ...` spans, and the lines of ```text blocks."""
    found = []
    for page in PAGES:
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        blocks = re.findall(r"```text\n(.*?)```", text, flags=re.S)
        found += [(page, line) for block in blocks for line in block.splitlines() if line.strip()]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(page, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", prose)
                  if span.startswith(("collabopt: ", "DiLoCo round "))]
    return found


QUOTES = quotes()


def test_the_pages_quote_log_lines():
    assert not [q for q in QUOTES if q[1].startswith("[WARNING]")], "hivemind prints [WARN]"
    assert len([q for q in QUOTES if q[0] == "troubleshooting.md"]) >= 20
    assert len([q for q in QUOTES if q[0] == "options.md"]) >= 5  # the verbose row


@pytest.mark.parametrize("page, quote", QUOTES, ids=[f"{p}: {q[:60]}" for p, q in QUOTES])
def test_each_quoted_line_is_printed_by_the_code(page, quote):
    hivemind_line = HIVEMIND_LINE.match(quote)
    if hivemind_line is None:
        assert printed_by(quote, all_literals()), f"{page} quotes a line no code prints: {quote!r}"
        return
    module, function, line, message = hivemind_line.groups()
    path = HIVEMIND.parent / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"{page}: no module {module}"
    source = path.read_text(encoding="utf-8").splitlines()
    assert "logger." in source[int(line) - 1], f"{page}: {module}:{line} logs nothing: {source[int(line) - 1]!r}"
    functions = [node for node in ast.walk(ast.parse("\n".join(source)))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.lineno <= int(line) <= node.end_lineno]
    innermost = min(functions, key=lambda node: node.end_lineno - node.lineno, default=None)
    assert innermost is not None and innermost.name == function, f"{page}: {module}:{line} is not in {function}()"
    assert printed_by(message, literals(path)) or printed_by(message, all_literals()), (page, quote)


def test_a_reworded_line_is_found():
    assert printed_by("collabopt: epoch 12 ends", all_literals())
    assert not printed_by("collabopt: epoch 12 is over", all_literals())
    assert not printed_by("collabopt: Proceeding with local gradients", all_literals())
