"""The documents the source cites are in the repository, and every citation names a heading there.

The source cites the design record as "DESIGN §n" (docs/design.md) and the protocol draft as
"KVSP §n" (its map, docs/protocol.md). The rule for a citation run ("DESIGN §3, §6", "KVSP
§6.5-§6.9"): the document named right before its first "§" holds every number of the run; a run
that names none cites the protocol, except inside docs/design.md, which cites itself, and a
Markdown page that numbers its own sections ("## 3. Title"), whose bare "§3" means its section 3;
a run after "draft-NN" or "RFC NNNN" cites another document and is not checked. A
heading "## §n Title" (any level) makes §n exist. Links in the Markdown documents and mentions
of `docs/...` files anywhere must name files that exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOCUMENTS = {"DESIGN": DOCS / "design.md", "KVSP": DOCS / "protocol.md"}
SOURCE_DIRS = ("kvsp_moq", "relay", "index", "pc", "agent", "interop", "fuzz", "tests",
               "tests_vllm", "scripts")
SKIP_PARTS = {".venv", ".venv-vllm", "__pycache__", "build", "dist", "out"}

NUMBER = r"\d+(?:\.\d+)*"
#: between two "§" of one run: a comma, a range dash or "and", across a line break of a comment
SEPARATOR = r"\s*(?:,|-|–|\band\b)\s*(?:#:?\s*)?"
RUN = re.compile(
    rf"(?:\b(?P<doc>DESIGN|KVSP|draft-\d+|RFC\s?\d+)\s+)?§(?P<first>{NUMBER})"
    rf"(?P<rest>(?:{SEPARATOR}§{NUMBER})*)")
HEADING = re.compile(rf"^#{{1,6}}\s+§({NUMBER})\b", re.M)
#: a section heading of a page that numbers its own sections
OWN_SECTION = re.compile(rf"^#{{1,6}}\s+({NUMBER})\.\s", re.M)
SELF = "this page"
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_MENTION = re.compile(r"(?<![\w/.])docs/[\w./-]*\w\.md\b")


class Citation(NamedTuple):
    path: str
    line: int
    document: str
    number: str


def citations(text: str, default: str, path: str = "") -> list[Citation]:
    """Every checked citation in `text`; `default` is the document a run without a name cites."""
    out = []
    for m in RUN.finditer(text):
        doc = m.group("doc") or default
        if doc not in DOCUMENTS and doc != SELF:
            continue  # another draft or an RFC
        line = text.count("\n", 0, m.start()) + 1
        for number in [m.group("first"), *re.findall(rf"§({NUMBER})", m.group("rest"))]:
            out.append(Citation(path, line, doc, number))
    return out


def headings(document: Path) -> list[str]:
    return HEADING.findall(document.read_text())


def source_files() -> list[Path]:
    """Python sources of every package and test tree, and the Markdown documents."""
    files = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    for name in SOURCE_DIRS:
        # Hidden folders hold installed packages (the interop peers' venvs), not ours.
        files += sorted(p for p in (ROOT / name).rglob("*.py")
                        if not SKIP_PARTS.intersection(p.relative_to(ROOT).parts)
                        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
    this = Path(__file__).resolve()
    return [p for p in files if p.resolve() != this]


def all_citations() -> list[Citation]:
    out = []
    for p in source_files():
        text = p.read_text(errors="replace")
        default = "KVSP"
        if p == DOCUMENTS["DESIGN"]:
            default = "DESIGN"
        elif p.suffix == ".md" and OWN_SECTION.search(text):
            default = SELF
        out += citations(text, default, str(p.relative_to(ROOT)))
    return out


def test_the_rule_reads_runs_as_written():
    text = ("(DESIGN §3, §6; KVSP §6.3, §6.5)  (§4.4, DESIGN §4)  KVSP §6.5-§6.9\n"
            "(§6.3,\n    #:   §6.8)  draft-18 §9.2  RFC 9000 §19.8  DESIGN §4.")
    got = [(c.document, c.number) for c in citations(text, "KVSP")]
    assert got == [("DESIGN", "3"), ("DESIGN", "6"), ("KVSP", "6.3"), ("KVSP", "6.5"),
                   ("KVSP", "4.4"), ("DESIGN", "4"), ("KVSP", "6.5"), ("KVSP", "6.9"),
                   ("KVSP", "6.3"), ("KVSP", "6.8"), ("DESIGN", "4")]
    assert [c.document for c in citations("(§3.13)", "DESIGN")] == ["DESIGN"]
    assert OWN_SECTION.findall("## 3. The API\n### 3.1. Calls\n## Files\n") == ["3", "3.1"]


def test_each_document_numbers_its_headings_once():
    for name, document in DOCUMENTS.items():
        numbers = headings(document)
        assert numbers, f"{document.relative_to(ROOT)} has no § headings"
        duplicates = sorted({n for n in numbers if numbers.count(n) > 1})
        assert not duplicates, f"{name}: headings numbered twice: {duplicates}"


def test_every_citation_names_a_heading():
    found = all_citations()
    # The source cites both documents throughout; a scan that finds few has lost its files.
    assert sum(c.document == "DESIGN" for c in found) > 40
    assert sum(c.document == "KVSP" for c in found) > 100
    known = {name: set(headings(document)) for name, document in DOCUMENTS.items()}

    def exists(c: Citation) -> bool:
        if c.document == SELF:
            return c.number in OWN_SECTION.findall((ROOT / c.path).read_text())
        return c.number in known[c.document]

    missing = [f"{c.path}:{c.line}: {c.document} §{c.number}" for c in found if not exists(c)]
    assert not missing, "citations of headings that do not exist:\n" + "\n".join(missing)


def test_links_and_mentions_of_documents_exist():
    broken = []
    for p in source_files():
        text = p.read_text(errors="replace")
        rel = str(p.relative_to(ROOT))
        if p.suffix == ".md":
            for target in MD_LINK.findall(text):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL or an anchor on the same page
                if not (p.parent / target.split("#")[0]).exists():
                    broken.append(f"{rel}: link {target}")
        for mention in DOCS_MENTION.findall(text):
            if not (ROOT / mention).exists():
                broken.append(f"{rel}: {mention}")
    assert not broken, "documents named that do not exist:\n" + "\n".join(broken)


def test_readme_links_the_documents():
    readme = (ROOT / "README.md").read_text()
    for name in ("docs/design.md", "docs/protocol.md", "docs/authorization.md"):
        assert f"]({name})" in readme, f"README does not link {name}"
