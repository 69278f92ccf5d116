"""The README is a front door and the reference lives in docs/: the flag table in
docs/configuration.md is the one ``Settings`` generates, every relative link and anchor in
the README and docs/ leads somewhere, the README stays short, and its test command is the
one CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_server.cli import build_parser
from mlx_server.config import settings_fields
from mlx_server.config.flag_table import TABLE_END, TABLE_START, flags_markdown

pytestmark = pytest.mark.tiny

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _committed_table() -> str:
    text = (DOCS / "configuration.md").read_text()
    return text[text.index(TABLE_START) + len(TABLE_START) : text.index(TABLE_END)].strip("\n")


def test_flag_table_is_the_generated_one():
    assert _committed_table() == flags_markdown().strip("\n"), (
        "docs/configuration.md's flag table differs from Settings: run "
        "python -m mlx_server.config --write docs/configuration.md"
    )


def test_flag_table_has_every_flag_and_its_variable():
    table = _committed_table()
    for f in settings_fields():
        assert f"`{f.metadata['flags'][-1]}`" in table, f.name
        assert f"`MLX_SERVER_{f.name.upper()}`" in table, f.name


def test_generator_writes_between_the_markers(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text(f"# Page\n\n{TABLE_START}\nstale\n{TABLE_END}\n\nAfter.\n")
    subprocess.run(
        [sys.executable, "-m", "mlx_server.config", "--write", str(doc)], check=True, timeout=120
    )
    text = doc.read_text()
    assert "stale" not in text and text.endswith(f"{TABLE_END}\n\nAfter.\n")
    assert flags_markdown() in text


def test_flags_in_hand_kept_tables_exist():
    """The tables the pages keep by hand (vision, several models, Jan's and the Swift
    server's flags) name only flags the server accepts."""
    accepted = set(build_parser({})._option_string_actions)
    unknown = []
    for page in PAGES:
        for row in re.findall(r"^\| (`-[^|]*)\|", page.read_text(), re.M):
            unknown += [
                f for f in re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", row) if f not in accepted
            ]
    assert not unknown


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    body = FENCE.sub("", page.read_text())
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", body, re.M)}


def _links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for t in _links(REPO / "README.md")}
    assert {p.name for p in DOCS.glob("*.md")} <= linked


def test_readme_is_a_front_door():
    assert (REPO / "README.md").stat().st_size <= 15 * 1024


def test_readme_test_command_is_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "bash scripts/test.sh"
    readme = (REPO / "README.md").read_text()
    assert "```bash\nbash scripts/test.sh\n```" in readme
    assert "```bash\nbash scripts/serve.sh\n```" in readme
