"""The docs' examples work as copied: the agent tests of docs/how-to/agents.md run in a
project of their own, the stub generation commands of docs/how-to/call.md run in an empty
directory, no snippet sends a fixed message id, every embedding snippet builds its server
with the service's interceptors and starts the service, and the README's links to the docs
land (mkdocs checks the docs' own links; the README is outside the site). Every page of
docs/, in subfolders too, is read. (docs/tutorial.md runs as written: test_tutorial.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify  # type: ignore[import-untyped]  # (mkdocs's)

from tests.support import ROOT

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NAMED = re.compile(r"^# ([\w.]+\.(?:py|toml))\b")
"""A block that opens with its file's name: ``# test_my_agent.py``."""


def blocks(page: Path, language: str | None = None) -> list[str]:
    """The fenced code blocks of ``page`` (of ``language`` only, if given)."""
    return [
        body
        for lang, body in FENCE.findall(page.read_text())
        if language is None or lang == language
    ]


def test_the_agent_and_its_tests_in_the_agents_page_run_as_written(tmp_path: Path) -> None:
    written = []
    for block in blocks(ROOT / "docs" / "how-to" / "agents.md"):
        if named := NAMED.match(block):
            (tmp_path / named.group(1)).write_text(block)
            written.append(named.group(1))
    assert {"my_agent.py", "test_my_agent.py", "pyproject.toml"} <= set(written), written
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "60"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b3 passed\b", done.stdout), done.stdout[-2000:]


def test_the_stub_generation_commands_run_as_copied(tmp_path: Path) -> None:
    page = ROOT / "docs" / "how-to" / "call.md"
    [commands] = [b for b in blocks(page, "bash") if "protoc" in b]
    (tmp_path / "proto").symlink_to(ROOT / "proto")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # (the checkout's .venv)
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    generated = tmp_path / "examples" / "gen" / "lf" / "a2a" / "v1"
    assert {"a2a_pb2.py", "a2a_pb2_grpc.py"} <= {p.name for p in generated.iterdir()}
    # (In a process of its own: a2a-sdk's types register the same names in this one.)
    subprocess.run(
        [sys.executable, "-c", "import lf.a2a.v1.a2a_pb2_grpc as g; g.A2AServiceStub"],
        cwd=tmp_path / "examples" / "gen",
        capture_output=True,
        timeout=60,
        check=True,
    )


FIXED_ID = re.compile(r"""message_id\s*=\s*["']|"messageId"\s*:\s*"[^$]""")


def snippets() -> list[tuple[str, str]]:
    """Every code block of the README and the docs, and every example program."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [
        (str(page.relative_to(ROOT)), block)
        for page in pages
        if page.name != "changelog.md"  # (history, not instructions)
        for block in blocks(page)
    ]
    found += [(p.name, p.read_text()) for p in sorted((ROOT / "examples").glob("*.py"))]
    return found


def test_no_snippet_sends_a_fixed_message_id() -> None:
    for where, text in snippets():
        fixed = FIXED_ID.search(text)
        assert fixed is None, f"{where}: {fixed and fixed.group(0)!r}: give each message a new id"


def test_every_embedding_snippet_adds_the_interceptors_and_starts_the_service() -> None:
    seen = 0
    for where, text in snippets():
        if "A2AService(" not in text or "grpc.aio.server(" not in text:
            continue
        seen += 1
        assert "interceptors=a2a.interceptors()" in text, f"{where}: no per-RPC metrics or spans"
        assert "await a2a.start()" in text, f"{where}: the service is never started"
    assert seen >= 3, "the README, docs/how-to/embed.md and examples/embed.py embed it"


LINK = re.compile(r"\]\(((?:docs/)?[\w./-]+?)(?:#([\w-]+))?\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives ``page``'s headings (markup dropped, then slugified)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {
        slugify(re.sub(r"`|\[|\]\([^)]*\)", "", title).strip(), "-")
        for title in HEADING.findall(text)
    }


def test_the_readmes_links_land_on_a_file_and_a_heading() -> None:
    links = LINK.findall((ROOT / "README.md").read_text())
    assert len(links) > 10
    for target, anchor in links:
        if target.startswith("http"):
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(ROOT / target), f"README.md: {target}#{anchor} is no heading"
