"""The README and docs/: every measured figure they quote is the one the results pages hold, every relative link
leads somewhere, and the README stays short.

The results are ``benchmarks/RESULTS.md``, an index, and one page per topic under ``benchmarks/results/``
(:data:`RESULT_PAGES`). The convention that makes figures checkable: a page quotes a measured figure as a link to
the section of the results page that measured it, e.g. ``[4.98 s](../benchmarks/results/deployment.md#a-section)``.
Every number in such a link's text must appear, as a number of its own, in that section. On the pages that state
figures (:data:`FIGURE_PAGES`) a figure with a unit (``85.90 %``, ``4.98 s``, ``3.1×``) outside such a link is
refused too, so a figure cannot be quoted without its source. Every measurement on a results page opens with the
same header (:data:`HEADER_FIELDS`).
"""

import re
import warnings
from pathlib import Path

import pytest

from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.runtime.flwr_cli import parse_overrides

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
"""The index of the results pages."""
RESULT_PAGES = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
"""One page per topic; a figure quoted elsewhere links to the section of one of them that measured it."""
HISTORY = ROOT / "benchmarks" / "results" / "history.md"
"""The measurements in the order they were made: links only, no measurement of its own."""
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK_PAGES = [*PAGES, RESULTS, *RESULT_PAGES, ROOT / "benchmarks" / "psinet" / "RESULTS.md"]
"""Pages whose relative links are checked (the results pages link each other's sections too)."""
FIGURE_PAGES = [README, ROOT / "docs" / "results.md"]
"""Pages whose figures must all be linked to their results section."""
HEADER_FIELDS = ("Date", "Commit", "Machine", "Command", "Scale", "Load")
"""The header every measurement on a results page opens with, in this order (then, optionally, its Status)."""
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?(?:%|×)|\s(?:s|ms|min|minutes|GiB|MiB|CPU-s|CPU-seconds|points)\b)"
)


def prose(markdown: str) -> str:
    """The text without code blocks and comments, where links and figures are read."""
    return HTML_COMMENT.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def sections(markdown: str) -> dict[str, str]:
    """Anchor → the section's text: from its heading to the next heading of the same or a higher level."""
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), markdown)  # a '#' in code is no heading
    headings = [(len(m.group(1)), slug(m.group(2)), m.start()) for m in HEADING.finditer(text)]
    found: dict[str, str] = {}
    for index, (level, anchor, start) in enumerate(headings):
        end = next((s for lvl, _, s in headings[index + 1 :] if lvl <= level), len(markdown))
        unique, count = anchor, 1
        while unique in found:  # GitHub numbers repeated headings: name, name-1, name-2
            unique, count = f"{anchor}-{count}", count + 1
        found[unique] = markdown[start:end]
    return found


def links(markdown: str) -> list[tuple[str, str]]:
    """(text, target) of every inline link and image outside code."""
    return [(m.group(1), m.group(2)) for m in LINK.finditer(INLINE_CODE.sub("", prose(markdown)))]


def has_number(number: str, text: str) -> bool:
    """Whether ``number`` stands in ``text`` as a number of its own (85.9 is not in 85.90, nor 20 in 1,200)."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)", text) is not None


def results_sources() -> dict[Path, str]:
    """Each results page (the index too) by its resolved path, with its text."""
    return {path.resolve(): path.read_text() for path in [RESULTS, *RESULT_PAGES]}


def is_results_link(target: str) -> bool:
    """Whether a link leads into a section of the results (the index or a topic page)."""
    path = target.partition("#")[0]
    return "#" in target and (path.endswith("RESULTS.md") or "/results/" in f"/{path}")


def figure_problems(markdown: str, page: Path, sources: dict[Path, str]) -> list[str]:
    """Each figure linked to a section of a results page (``sources``: resolved path → text) that the section
    does not hold, and each link to a results page with a figure but no section."""
    problems = []
    for text, target in links(markdown):
        path, _, anchor = target.partition("#")
        source = sources.get((page.parent / path).resolve()) if path else None
        if source is None:
            continue
        numbers = NUMBER.findall(text)
        if not numbers:
            continue
        parts = sections(source)
        if anchor not in parts:
            problems.append(f"'{text}' links to {path}#{anchor}, which is no section of it")
            continue
        missing = [n for n in numbers if not has_number(n, parts[anchor])]
        if missing:
            problems.append(f"'{text}': {missing} not in {Path(path).name}'s section #{anchor}")
    return problems


def untagged_figures(markdown: str) -> list[str]:
    """Figures with a unit that are not inside a link (to their source) or code."""
    bare = LINK.sub("", INLINE_CODE.sub("", prose(markdown)))
    return [m.group(0) for m in FIGURE.finditer(bare)]


def link_problems(page: Path, markdown: str | None = None) -> list[str]:
    """Relative links and images of ``page`` (or of ``markdown`` read as if it stood there) whose file or heading
    does not exist."""
    markdown = page.read_text() if markdown is None else markdown
    problems = []
    for text, target in links(markdown):
        if re.match(r"^[a-z][a-z+.-]*:", target):  # http:, https:, mailto: are not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"'{text}' → {target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in sections(file.read_text()):
            problems.append(f"'{text}' → {target}: no heading #{anchor} in {file.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_figure_linked_to_results_is_the_one_results_holds(page):
    assert figure_problems(page.read_text(), page, results_sources()) == []


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda p: p.name)
def test_every_figure_on_the_figure_pages_names_its_source(page):
    assert untagged_figures(page.read_text()) == [], f"{page.name}: link these figures to their results section"


@pytest.mark.parametrize("page", LINK_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    assert link_problems(page) == []


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "results.md"], ids=lambda p: p.name)
def test_a_link_to_a_renamed_heading_is_caught_on_the_real_pages(page):
    """A link into a results page whose heading was renamed (its anchor no longer exists) is caught."""
    markdown = page.read_text()
    target = next(target for _, target in links(markdown) if is_results_link(target))
    stale = markdown.replace(f"]({target})", f"]({target}-old-tail)", 1)
    assert [problem for problem in link_problems(page, stale) if "no heading" in problem], target


@pytest.mark.parametrize("page", [RESULTS, *RESULT_PAGES], ids=lambda p: p.name)
def test_results_headings_are_unique(page):
    """Two headings with one anchor would send a link to whichever comes first (GitHub numbers the rest)."""
    text = FENCE.sub("", page.read_text())
    anchors = [slug(m.group(2)) for m in HEADING.finditer(text)]
    assert sorted({a for a in anchors if anchors.count(a) > 1}) == []


def header_problems(markdown: str) -> list[str]:
    """Each measurement header (it starts at a ``- **Date:**`` line) whose fields are not :data:`HEADER_FIELDS`
    in order, and a page with no header at all."""
    rows = prose(markdown).splitlines()
    starts = [index for index, row in enumerate(rows) if row.startswith("- **Date:**")]
    if not starts:
        return ["no measurement header"]
    problems = []
    for start in starts:
        fields = [re.match(r"- \*\*(\w+):\*\*", row) for row in rows[start : start + len(HEADER_FIELDS)]]
        names = tuple(match.group(1) if match else "" for match in fields)
        if names != HEADER_FIELDS:
            problems.append(f"header at line {start + 1}: {names}")
    return problems


@pytest.mark.parametrize("page", [p for p in RESULT_PAGES if p != HISTORY], ids=lambda p: p.name)
def test_every_results_page_opens_its_measurements_with_the_header(page):
    assert header_problems(page.read_text()) == []


@pytest.mark.parametrize(
    ("page", "problem"),
    [
        (
            "## A\n\n- **Date:** 1\n- **Commit:** x\n- **Machine:** m\n- **Command:** c\n- **Scale:** s\n- **Load:** 1\n",
            None,
        ),
        ("## A\n\n- **Date:** 1\n- **Commit:** x\n- **Machine:** m\n- **Scale:** s\n- **Load:** 1\n", "line 3"),
        ("## A\n\nno header here\n", "no measurement header"),
    ],
)
def test_the_header_checker_on_right_and_wrong_headers(page, problem):
    problems = header_problems(page)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]


def test_the_index_links_every_results_page():
    """A topic page nobody links from the index is a page a reader cannot find."""
    targets = {(RESULTS.parent / target.partition("#")[0]).resolve() for _, target in links(RESULTS.read_text())}
    assert [page.name for page in RESULT_PAGES if page.resolve() not in targets] == []


RUN_CONFIG = re.compile(r"--run-config '([^']*)'")


def documented_run_configs(markdown: str) -> list[str]:
    """The ``--run-config '...'`` strings of the page's command blocks."""
    return [m.group(1) for block in FENCE.finditer(markdown) for m in RUN_CONFIG.finditer(block.group(0))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_documented_run_config_is_accepted(page):
    """A renamed or removed key, or a value out of range, in a command the docs show fails here, not in a
    reader's terminal (the model-and-algorithm fit is checked by the launcher's own tests)."""
    for text in documented_run_configs(page.read_text()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # an old key name, read under its new one
            parse_run_config(parse_overrides(text))


def test_documented_run_configs_are_found():
    commands = documented_run_configs(README.read_text())
    assert len(commands) >= 7 and any('strategy="superfed"' in c for c in commands)
    with pytest.raises(ValueError, match="fedprox-mu"):
        parse_run_config(parse_overrides('strategy="fedavg" fedprox-mu=0.5'))


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_readme_quotes_figures_and_the_checker_catches_a_wrong_one():
    """The README quotes at least one figure through the convention; changing its digits is caught."""
    readme = README.read_text()
    quoted = [(t, target) for t, target in links(readme) if is_results_link(target) and NUMBER.search(t)]
    assert quoted, "the README quotes no figure from the results pages"
    text, target = quoted[0]
    number = NUMBER.search(text).group(0)
    wrong = text.replace(number, number[:-1] + ("1" if number[-1] != "1" else "2"), 1)
    altered = readme.replace(f"[{text}]({target})", f"[{wrong}]({target})", 1)
    assert figure_problems(altered, README, results_sources()), f"a wrong '{wrong}' was not caught"


RESULTS_SAMPLE = """# Results

## The default run

```
# not a heading: a comment in a command block, long enough to shift every offset after it if code were cut out
python -m alignfl.fl_app.launch
```

| run | final accuracy |
|---|---|
| run.sh | 85.90 % (best 86.12) |

## Deployment round

Round: 4.98 s (median); single rounds 4.0–5.6 s; 10,000 clients.
"""


@pytest.mark.parametrize(
    ("page", "problem"),
    [
        ("[85.90 %](RESULTS.md#the-default-run)", None),
        ("[85.82 %](RESULTS.md#the-default-run)", "['85.82'] not in"),
        ("[85.9 %](RESULTS.md#the-default-run)", "['85.9'] not in"),  # a rounded figure is another figure
        ("[4.98 s](RESULTS.md#the-default-run)", "['4.98'] not in"),  # right figure, wrong section
        ("[4.0–5.6 s](RESULTS.md#deployment-round)", None),
        ("[4.0–5.7 s](RESULTS.md#deployment-round)", "['5.7'] not in"),
        ("[1,000 clients](RESULTS.md#deployment-round)", "['1,000'] not in"),
        ("[about 20 s](RESULTS.md#deployment-round)", "['20'] not in"),
        ("[4.98 s](RESULTS.md#no-such-section)", "no section"),
        ("[4.98 s](RESULTS.md#not-a-heading-a-comment-in-a-command-block)", "no section"),
        ("[4.98 s](RESULTS.md)", "no section"),
        ("[the table](RESULTS.md#deployment-round)", None),  # no figure, nothing to check
        ("`[85.82 %](RESULTS.md#the-default-run)`", None),  # code is not read
    ],
)
def test_the_figure_checker_on_right_and_wrong_figures(tmp_path, page, problem):
    problems = figure_problems(page, tmp_path / "page.md", {(tmp_path / "RESULTS.md").resolve(): RESULTS_SAMPLE})
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]


@pytest.mark.parametrize(
    ("page", "untagged"),
    [
        ("a round takes about 20 s on 2 cores", ["20 s"]),
        ("it reaches 85.82 % after 10 rounds", ["85.82 %"]),
        ("3.1× faster", ["3.1×"]),
        ("it reaches [85.90 %](RESULTS.md#x)", []),
        ("`--num-gpus 0.25`, 10 rounds, Python 3.11, port 9093", []),
        ("```\nround 3: 52 s\n```", []),
    ],
)
def test_untagged_figures_are_found(page, untagged):
    assert untagged_figures(page) == untagged


def test_the_link_checker_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Some part\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-part) [ok](#top) [web](https://example.org/x)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#other-part) ![img](fig.png)\n\n# Top\n"
    )
    problems = link_problems(page)
    assert len(problems) == 3
    assert "no file" in problems[0] and "no heading #other-part" in problems[1] and "fig.png" in problems[2]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("PANs off versus on under FedAvg across α (issue 3)", "pans-off-versus-on-under-fedavg-across-α-issue-3"),
        ("The default run: `./scripts/run.sh`", "the-default-run-scriptsrunsh"),
        ("Ψ-Net grouped averaging", "ψ-net-grouped-averaging"),
    ],
)
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor
