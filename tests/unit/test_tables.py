"""README.md and the user docs: their results tables are the results files', and they carry no history.

The tables between ``<!-- results:NAME:begin/end -->`` markers are written by ``benchmarks/tables.py`` from
``benchmarks/results/*.json``; ``--check`` fails when a file differs from what it would write, so the README, the
docs and the results cannot disagree. Users read the present: a commit hash, a run's date or an issue number belongs
in CHANGELOG.md and the commit messages, not in README.md or a user page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import tables

ROOT = Path(__file__).resolve().parents[2]
USER_PAGES = ["index", "getting-started", "concepts", "joining", "options", "faults", "troubleshooting",
              "performance", "scale"]
HISTORY = {
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "an issue number": re.compile(r"\bissues? #?\d+|(?<![\w/])#\d{2,}\b", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


def user_docs() -> list[Path]:
    return ([ROOT / "README.md"] + [ROOT / "docs" / f"{name}.md" for name in USER_PAGES]
            + sorted((ROOT / "docs" / "guides").glob("*.md")))


def prose(text: str) -> str:
    """``text`` without fenced code blocks, inline code and link targets (peer ids and URLs are not history)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def history_in(text: str) -> list[str]:
    text = prose(text)
    return [f"{what}: {match.group(0)!r}" for what, pattern in HISTORY.items() for match in pattern.finditer(text)]


def test_the_tables_are_the_results_files() -> None:
    assert tables.main(["--check"]) == 0, "run: python -m benchmarks.tables"


def test_every_results_block_is_known_and_every_file_has_one() -> None:
    for path in tables.FILES:
        names = re.findall(r"<!-- results:([\w-]+):begin -->", path.read_text(encoding="utf-8"))
        assert names, f"{path} has no results block"
        assert set(names) <= set(tables.BLOCKS), f"{path}: unknown blocks {set(names) - set(tables.BLOCKS)}"


def test_a_stale_table_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- results:b4:begin -->\n| old | 9.99 |\n<!-- results:b4:end -->\nafter\n")
    monkeypatch.setattr(tables, "FILES", [page])
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.main(["--check"]) == 1
    assert "9.99" in page.read_text()  # --check writes nothing
    assert tables.main([]) == 0
    written = page.read_text()
    assert "9.99" not in written and "| `offload_optimizer` | 5.00 |" in written
    assert written.startswith("before\n") and written.endswith("after\n")
    assert tables.main(["--check"]) == 0


@pytest.mark.parametrize("path", user_docs(), ids=lambda path: path.name)
def test_no_history_in_readme_and_user_docs(path: Path) -> None:
    found = history_in(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: {found} (history belongs in CHANGELOG.md and commit messages)"


def test_the_history_check_can_fail() -> None:
    assert history_in("measured at git 3ae787c, see issue 32, run of 2026-11-27") == [
        "a commit hash: '3ae787c'", "an issue number: 'issue 32'", "a date: '2026-11-27'"]
    assert history_in("peer `12D3KooWabc1234567` at [link](x#3ae787c); 1,000,000 params; deadbeef") == []
