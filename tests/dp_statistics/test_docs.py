"""The statistics docs: statistics.md is the user guide, dp-aggregation.md the operator's
internals and benchmark. They link to each other, repeat no text, and the guide's Python names
exist (a renamed function would leave users a dead example)."""
import re
from pathlib import Path

from sage_tfx.dp_statistics.aggregation import frontend

DOCS = Path(__file__).resolve().parents[2] / "docs"


def lines(name):
    return {" ".join(line.split()) for line in (DOCS / name).read_text().splitlines()}


def test_the_guide_and_the_internals_link_each_other_and_share_no_line():
    guide = (DOCS / "statistics.md").read_text()
    internals = (DOCS / "dp-aggregation.md").read_text()
    assert "](dp-aggregation.md)" in guide and "](statistics.md)" in internals
    shared = {line for line in lines("statistics.md") & lines("dp-aggregation.md")
              if len(line) > 40 and not line.startswith(("```", "|"))}
    assert not shared


def test_the_guides_python_names_exist():
    guide = (DOCS / "statistics.md").read_text()
    named = set(re.findall(r"frontend\.(\w+)", guide))
    assert {"plan_query", "dp_aggregate", "grant_terms"} <= named
    assert all(hasattr(frontend, name) for name in named)
