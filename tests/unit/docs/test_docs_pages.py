"""The docs stay readable and findable: every page within scripts/docstats' bounds (words
per sentence, a heading every few hundred words, the README under 12 KB), the counter
itself counts as it says, and every ``docs/….md`` that code, tests, examples or the
benchmarks name is a page that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT, script


def test_the_counter_counts_prose_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n"
        "One two three. Four five six seven, e.g. eight!\n\n"
        "```bash\nnot prose at all here\n```\n\n"
        "| a table | is | not prose |\n|---|---|---|\n\n"
        "## Second\n\n"
        "- an item without a stop\n"
        "- another item. With two sentences.\n\n"
        "See [the link text](https://example.com/not/counted).\n"
    )
    m = script("docstats").measure(page)
    assert m["words"] == 9 + 5 + 5 + 4
    assert m["sentences"] == 2 + 1 + 2 + 1
    assert m["headings"] == 2
    assert m["longest"] == 14


def test_a_page_past_the_bounds_is_named(tmp_path: Path) -> None:
    page = tmp_path / "long.md"
    page.write_text("# Long\n\n" + "word " * 30 + "end.\n\n" + ("Short one. " * 250) + "\n")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docstats"), "--check", str(page)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert "without a heading" in run.stderr and "words per heading" in run.stderr


def test_every_docs_page_is_within_the_bounds() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docstats"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"


NAMED_PAGE = re.compile(r"\bdocs/([\w./-]+?\.md)\b")


def test_every_page_named_outside_the_docs_exists() -> None:
    places = [
        p
        for folder in ("server", "tests", "examples", "bench", "scripts")
        for p in (ROOT / folder).rglob("*")
        if p.is_file()
        and p.suffix in {".py", ".md", ".yaml", ".toml", ""}
        and "fixtures" not in p.parts
        and not any(part.endswith(".egg-info") for part in p.parts)
    ]
    places += [ROOT / "README.md", ROOT / "pyproject.toml"]
    seen = 0
    for place in places:
        try:
            text = place.read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        for name in NAMED_PAGE.findall(text):
            if name.startswith("gen-ai/"):  # (a page of OpenTelemetry's repository)
                continue
            seen += 1
            assert (ROOT / "docs" / name).exists(), f"{place.relative_to(ROOT)} names docs/{name}"
    assert seen >= 10, "code and tests do name docs pages"
