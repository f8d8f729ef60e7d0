"""The repository's documentation only points at things a reader of the repository can open.

* No tracked file cites design notes that are not in the repository (the old section-sign forms of
  the spec, style and seed notes listed in FORBIDDEN; docs/DESIGN.md carries that material) or names
  a path that exists only on a development machine (FORBIDDEN's last three patterns).
* Every relative markdown link in README.md and docs/*.md (and the other tracked .md files) names a
  file that exists, and every `#anchor` into a markdown file names one of its headings, using
  GitHub's anchor rule (lower case; punctuation other than `-` and `_` dropped; spaces to `-`;
  repeated headings get `-1`, `-2`, ...).
* Every repository path the README names in backticks exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Old citation forms of unpublished notes, and development-machine paths. Built from pieces so that
# this file does not match itself when read by a plain `git grep`.
FORBIDDEN = re.compile(
    "|".join(
        [
            "SPEC" + r"\s*§",
            "STYLE" + r"\s*§",
            r"(?i:seed)" + r"\s+00\d",
            r"shared/" + "seeds",
            r"shared/" + "SPEC",
            r"SPEC" + r"\.md",
            r"STYLE" + r"\.md",
            r"/" + r"work/",
            r"/" + r"home/",
            r"\.\./" + r"shared\b",
        ]
    )
)

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
REPO_DIRS = ("kvsched/", "bench/", "docs/", "examples/", "systemd/", "deploy/", "tests/")


def tracked_files() -> list[str]:
    """Tracked files (git ls-files), or every file outside ignored directories without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
        if names:
            return [n for n in names if (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = {".git", ".venv", ".numba-cache", ".pytest_cache", ".hypothesis", "out", "__pycache__", ".mypy_cache"}
    return [
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*")
        if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
    ]


def strip_fences(markdown: str) -> str:
    """`markdown` with the lines of fenced code blocks (fences included) blanked."""
    out, fence = [], ""
    for line in markdown.split("\n"):
        m = FENCE_LINE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
                fence = ""
            out.append("")
        elif m:
            fence = m.group(1)
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def forbidden_hits(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every forbidden citation or path in `text`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in FORBIDDEN.finditer(text)]


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w is Unicode-aware: letters, digits, underscore
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor GitHub generates for the headings of `markdown` (fenced code excluded)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in HEADING.finditer(strip_fences(markdown)):
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(markdown: str) -> list[str]:
    """Link targets of `markdown`: inline links, images and reference definitions, outside code."""
    text = CODE_SPAN.sub("", strip_fences(markdown))
    return [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in REF_DEF.finditer(text)]


def broken_links(md_path: Path) -> list[str]:
    """Relative link targets of the markdown file `md_path` that name no file or no heading."""
    bad = []
    for target in links(md_path.read_text(encoding="utf-8")):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # absolute URL (https:, mailto:, ...): not checked offline
        path_part, _, anchor = target.partition("#")
        dest = (md_path.parent / path_part).resolve() if path_part else md_path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return bad


def markdown_files() -> list[Path]:
    return sorted(ROOT / n for n in tracked_files() if n.endswith(".md"))


# ---------------------------------------------------------------------------- the checkers themselves


def test_forbidden_pattern_catches_old_citations_and_machine_paths() -> None:
    planted = "\n".join(
        [
            "ok line",
            "see " + "SPEC" + " §4 here",
            "(" + "STYLE" + " §8)",
            "Seed" + " 003's interface",
            "/" + "work/shared/traces/x.jsonl",
            "../" + "shared/" + "seeds/000.md",
            "/" + "home/user/x",
        ]
    )
    assert [line for line, _ in forbidden_hits(planted)] == [2, 3, 4, 5, 6, 7]
    assert forbidden_hits("docs/DESIGN.md §4.4; random seed 0; seeds 3; /run/kvsched; ./work") == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("4.4 Orderings", "44-orderings"),
        ("2.4 Daemon to router, rejection reasons", "24-daemon-to-router-rejection-reasons"),
        ("4.2 Busy, overload, capacity; placeable, eligible", "42-busy-overload-capacity-placeable-eligible"),
        ("4.11 admit_one", "411-admit_one"),
        ("Run it in front of vLLM", "run-it-in-front-of-vllm"),
        ("Routers on other hosts (TCP + CURVE)", "routers-on-other-hosts-tcp--curve"),
        ("`kvsched.toml` keys", "kvschedtoml-keys"),
        ("Size `/dev/shm`", "size-devshm"),
    ],
)
def test_github_anchor_rule(heading: str, anchor: str) -> None:
    assert github_anchor(heading) == anchor


def test_duplicate_headings_get_numbered_anchors_and_code_is_ignored() -> None:
    md = "# A\n## Setup\n```\n# not a heading\n```\n## Setup\n## Setup\n"
    assert anchors(md) == {"a", "setup", "setup-1", "setup-2"}


def test_broken_links_are_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n## 1.2 Discovery\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#12-discovery) [ok](#here) [web](https://example.com/x#y)\n"
        "# Here\n[bad](missing.md) [bad](other.md#13-nothing) [bad](#nowhere)\n"
        "`[code](missing-in-code.md)`\n```\n[fenced](missing-fenced.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#13-nothing: no heading with anchor #13-nothing in other.md",
        "#nowhere: no heading with anchor #nowhere in page.md",
    ]


# ---------------------------------------------------------------------------- the repository


def test_no_unpublished_citations_or_machine_paths_in_tracked_files() -> None:
    bad = []
    for name in tracked_files():
        if name == THIS:
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (plots)
        bad += [f"{name}:{line}: {hit}" for line, hit in forbidden_hits(text)]
    assert not bad, "cite docs/DESIGN.md (or a public source) instead:\n" + "\n".join(bad)


def test_readme_and_docs_exist_and_are_checked() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/DESIGN.md", "docs/PROTOCOL.md", "docs/ARCHITECTURE.md"} <= names


def test_every_relative_markdown_link_resolves() -> None:
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in markdown_files() for b in broken_links(p)]
    assert not bad, "\n".join(bad)


DESIGN_CITE = re.compile(r"DESIGN(?:\.md)?\s+§\d+(?:\.\d+)*(?:(?:,\s*|\s+and\s+|;\s*\w+\s+)§\d+(?:\.\d+)*)*")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
NAMED_CITE = re.compile(r"docs/([A-Z_]+\.md)\s+\"([^\"]+)\"")


def heading_texts(markdown: str) -> list[str]:
    """Every heading's text of `markdown`, inline code marks dropped (fenced code excluded)."""
    return [CODE_SPAN.sub(lambda m: m.group(2), h.group(2)).strip() for h in HEADING.finditer(strip_fences(markdown))]


def bad_section_citations(text: str, design_headings: list[str], docs: dict[str, list[str]]) -> list[str]:
    """`DESIGN.md §N.M` citations with no such numbered heading, and `docs/X.md "Heading"` citations
    whose page has no heading of that name (its number, if any, aside), in `text`."""
    numbers = {h.split()[0] for h in design_headings if h[:1].isdigit()}
    bad = [f"§{n}" for m in DESIGN_CITE.finditer(text) for n in SECTION.findall(m.group(0)) if n not in numbers]
    for m in NAMED_CITE.finditer(text):
        names = {re.sub(r"^\d+(?:\.\d+)*\s+", "", h).lower() for h in docs.get(m.group(1), [])}
        if m.group(2).lower() not in names:
            bad.append(f'docs/{m.group(1)} "{m.group(2)}"')
    return bad


def test_section_citation_checker() -> None:
    design = ["kvsched design", "4 Scheduling semantics", "4.4 Orderings", "4.17 Guardrails"]
    docs = {"DESIGN.md": design, "DEPLOY.md": ["Deploying", "Health endpoints"]}
    good = 'docs/DESIGN.md §4.4; (DESIGN.md §4, §4.17) [DESIGN §4.4] docs/DEPLOY.md "Health endpoints"'
    assert bad_section_citations(good, design, docs) == []
    bad = 'docs/DESIGN.md §4.5; (DESIGN.md §4, §9.1; guardrails §4.18) docs/DEPLOY.md "Probes"'
    assert bad_section_citations(bad, design, docs) == ["§4.5", "§9.1", "§4.18", 'docs/DEPLOY.md "Probes"']


def test_section_citations_name_existing_sections() -> None:
    docs = {p.name: heading_texts(p.read_text(encoding="utf-8")) for p in (ROOT / "docs").glob("*.md")}
    bad = []
    for name in tracked_files():
        if name == THIS:
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bad += [f"{name}: {b}" for b in bad_section_citations(text, docs["DESIGN.md"], docs)]
    assert not bad, "\n".join(bad)


def test_repository_paths_named_in_the_readme_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = []
    for m in CODE_SPAN.finditer(readme):
        for word in m.group(2).split():
            word = word.strip("`'\",;:()")
            if word.startswith(REPO_DIRS) and not re.search(r"[<>*{}$]", word) and not (ROOT / word).exists():
                missing.append(word)
    assert not missing, "README names files that are not in the repository: " + ", ".join(missing)
