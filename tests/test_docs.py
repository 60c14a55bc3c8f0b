"""Every doc the code cites is in the repo, with the section it names; the README stays a newcomer's page.

A citation is `docs/<name>.md`, optionally with a section as a GitHub anchor: `docs/algorithm.md#grace-window`
is the heading "Grace window" of docs/algorithm.md. Inside docs/, relative links (`design.md#ledgers`,
`#merge`) are checked the same way. The background specs outside the repo must not be cited at all.
Every repo path the markdown names (`diloco/store/keys.py`, `diloco/runtime/procs/`) exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".yaml", ".yml", ".ipynb", ".md")
CITATION = re.compile(r"(?<![\w/.-])docs/([\w.-]+?\.md)(?:#([\w-]+))?")
LINK = re.compile(r"\]\(([\w.-]+\.md)?(?:#([\w-]+))?\)")  # relative markdown links, inside docs/
# A repo file by path (a .py, .yaml, .ipynb or .md under a top-level folder of code) or a folder
# by its trailing slash; `<run>/store`, globs and strings such as `diloco/piece` are not paths.
REPO_PATH = re.compile(r"(?<![\w/.<-])((?:diloco|scripts|tests|benchmarks|configs|notebooks)/[\w/.-]*?"
                       r"(?:\.(?:py|yaml|ipynb|md)\b|/(?![\w.*<-])))")
# The upper-case spec files that lived outside the repo (spelled in two parts so this file passes).
OUTSIDE = re.compile(r"\b(?:ALGORITHM|DESIGN|EXPERIMENTS)" + r"\.md\b")


def tracked_files() -> list[Path]:
    """Files git tracks plus new ones it does not ignore; without git, a walk that skips build output."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        paths = [ROOT / line for line in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".venv-parity", "runs", "results", "data", "node_modules"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return sorted(p for p in paths if p.suffix in SUFFIXES and p.is_file())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().replace("`", "").replace("*", "").lower()  # code and emphasis marks
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> list[str]:
    """The anchors of every heading outside code fences, in order."""
    out, fenced = [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(slug(line.lstrip("#")))
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_slug_matches_github():
    assert slug("Grace window") == "grace-window"
    assert slug("T1 Quality against data parallel") == "t1-quality-against-data-parallel"
    assert slug("SmolLM2-135M-Instruct, end to end") == "smollm2-135m-instruct-end-to-end"
    assert slug("Loading and saving (`diloco.hf`)") == "loading-and-saving-dilocohf"


def test_every_cited_doc_and_section_exists():
    known: dict[str, set[str]] = {}

    def check(where: str, name: str, section: str | None, problems: list[str]) -> None:
        doc = ROOT / "docs" / name
        if not doc.is_file():
            problems.append(f"{where}: cites docs/{name}, which does not exist")
            return
        if section:
            if name not in known:
                known[name] = set(anchors(doc))
            if section not in known[name]:
                problems.append(f"{where}: cites docs/{name}#{section}, but docs/{name} has no such heading "
                                f"(its anchors: {', '.join(sorted(known[name]))})")

    problems: list[str] = []
    for path in tracked_files():
        in_docs = path.parent == ROOT / "docs"
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            where = f"{rel(path)}:{n}"
            for m in CITATION.finditer(line):
                check(where, m[1], m[2], problems)
            if in_docs:
                for m in LINK.finditer(line):
                    check(where, m[1] or path.name, m[2], problems)
            elif OUTSIDE.search(line) and path != Path(__file__).resolve():
                problems.append(f"{where}: names {OUTSIDE.search(line)[0]}, a file outside the repo; "
                                "cite the doc in docs/ that holds it (docs/algorithm.md, docs/design.md, "
                                "docs/experiments.md)")
    assert not problems, "broken doc citations:\n" + "\n".join(problems)


def test_doc_headings_are_unique_so_anchors_are_stable():
    for doc in sorted((ROOT / "docs").glob("*.md")):
        seen = anchors(doc)
        repeated = sorted({a for a in seen if seen.count(a) > 1})
        assert not repeated, f"{rel(doc)}: headings repeat, so GitHub numbers their anchors: {repeated}"


def test_readme_is_a_newcomers_page():
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert 8_000 <= size <= 16_000, (f"README.md is {size} bytes; keep it between 8 and 16 kB and move long "
                                     "tables and analyses to docs/experiments.md")
    text = readme.read_text(encoding="utf-8")
    assert "pypi.org" not in text, "name packages by name and pip command, not by a package index URL"


def test_every_repo_path_the_markdown_names_exists():
    """A file moved or renamed leaves no stale path behind in the README or docs/."""
    problems = []
    for path in tracked_files():
        if path.suffix != ".md":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            problems += [f"{rel(path)}:{n}: names {m[1]}, which does not exist"
                         for m in REPO_PATH.finditer(line) if not (ROOT / m[1]).exists()]
    assert not problems, "stale paths in the docs:\n" + "\n".join(problems)
