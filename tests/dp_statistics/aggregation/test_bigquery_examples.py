"""The examples of BigQuery's "Differentially private aggregate functions" page, run verbatim
(their query text, comments and semicolons included) with `sage-tfx query` against a table
ingested with `sage-tfx ingest` under their names: `professors` with `id` (the privacy unit,
declared an integer), `item` and `quantity` (issue 48). The page is generated from the same
source as ZetaSQL's docs/aggregate-dp-functions.md; these are its examples on the table
`professors` with `privacy_unit_column=id` (the others read a ZetaSQL view BigQuery has not),
and the example of its DP clause's "Add noise" and "Limit the groups" sections.

Our own data, not theirs (their 8 rows would lose most groups to selection at any epsilon):
240 professors per item, each requesting one item 1 to 3 times, quantities 1..30. Their outputs
are noisy; what is asserted is the structure (the item column and the alias, every item kept:
240 units against a selection threshold of a few units) and each value within 6 noise scales
of the exact one (the noise is `seeded_noise`'s fixed draw; a correct release falls outside
with probability e^-6 per value under Laplace noise).

Their "without noise" examples set epsilon = 1e20: refused, saying why (a release without
noise has no DP guarantee), with nothing charged."""
import csv
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sage_tfx.cli import main
from sage_tfx.sage_access import BlockLedger

# The page's examples on `professors`, verbatim, in bigquery_examples.sql beside this file (one
# per block): the first six with noise, then four without.
_BLOCKS = (Path(__file__).with_name("bigquery_examples.sql").read_text()
           .split("\n\n")[1:])
# Per example with noise: its output column, the statistic of an item's rows it estimates, and
# the tolerance. Tolerances, 6 noise scales at epsilon 10 with max_groups_contributed = 1
# (selection weight 1, truncated geometric; pure Laplace events, so no PLD gain): COUNT and
# SUM with contribution_bounds_per_group => (0, 100) are the unit's total clamped into
# [0, 100], sensitivity 100 at epsilon 5: scale 20; AVG at epsilon 6.67, its centred sum (m = 8
# rows, h = 50) at 59/100 of it: scale 102, over ~480 rows 0.3 in the mean; PERCENTILE_CONT
# reads a tree of 64 leaves of width 1.6. The DP clause's "Add noise" (the sixth):
# max_groups_contributed = 2, the default selection (the weighted Gaussian), noise for 2 groups:
# the mean's tolerance doubles.
EXPECTED = [("average_quantity", "mean", 6 * 0.3), ("times_requested", "size", 6 * 20),
            ("times_requested", "size", 6 * 20), ("percentile_requested", "median", 5.0),
            ("quantity", "sum", 6 * 20), ("average_quantity", "mean", 2 * 6 * 0.3)]
EXAMPLES = [(text.strip(), *expected) for text, expected in zip(_BLOCKS, EXPECTED)]
# The page's (and the DP clause's) examples without noise: epsilon = 1e20.
WITHOUT_NOISE = [text.strip() for text in _BLOCKS[len(EXPECTED):]]
assert len(WITHOUT_NOISE) == 4 and all("epsilon=1e20" in text for text in WITHOUT_NOISE)

ITEMS = ("pen", "pencil", "scissors")


@pytest.fixture
def professors(tmp_path, store_path, capsys):
    """The ingested table and the exact per-item statistics of its rows."""
    BlockLedger.create(store_path)
    rng = np.random.default_rng(48)
    rows = [(100 + 1000 * index + unit, item, int(rng.integers(1, 31)))
            for index, item in enumerate(ITEMS) for unit in range(240)
            for _ in range(int(rng.integers(1, 4)))]
    path = tmp_path / "professors.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "item", "quantity"])
        writer.writerows(rows)
    assert main(["ingest", "--store", store_path, "--csv", str(path), "--unit-column", "id",
                 "--user-blocks", "1", "--types", "id:int,quantity:int", "--epsilon", "200",
                 "--delta", "0.5", "--out", str(tmp_path / "blocks")]) == 0
    # a typed unit column is accepted, read as text, and said once
    assert capsys.readouterr().err.count("the unit column 'id' is read as text") == 1
    frame = pd.DataFrame(rows, columns=["id", "item", "quantity"])
    exact = frame.groupby("item")["quantity"].agg(["size", "sum", "mean", "median"])
    return store_path, exact


def _query(store, text, out=None):
    arguments = ["query", "--store", store, "--window", "1", "--epsilon", "10",
                 "--delta", ".01"]
    return main(arguments + (["--out", str(out)] if out else []) + [text])


@pytest.mark.parametrize("text, column, statistic, tolerance", EXAMPLES)
def test_each_example_of_the_page_runs_verbatim(professors, tmp_path, seeded_noise, capsys,
                                                text, column, statistic, tolerance):
    store, exact = professors
    out = tmp_path / "release.csv"
    assert _query(store, text, out) == 0, capsys.readouterr().err
    released = pd.read_csv(out)
    assert list(released.columns) == ["item", column]
    assert sorted(released["item"]) == list(ITEMS)  # 240 units an item: every group kept
    values = released.set_index("item")[column]
    for item in ITEMS:
        assert abs(values[item] - exact.loc[item, statistic]) < tolerance, (item, values[item])


@pytest.mark.parametrize("text", WITHOUT_NOISE)
def test_the_examples_without_noise_are_refused_saying_why(professors, capsys, text):
    store, _ = professors
    assert _query(store, text) == 2
    message = capsys.readouterr().err
    assert "OPTIONS epsilon = 1e+20" in message and "no differential-privacy guarantee" in \
        message and "nothing was charged" in message, message
    assert BlockLedger(store).grant_records() == []


def test_bigquerys_group_selection_strategy_names_a_selection_rule():
    from sage_tfx.dp_statistics.aggregation import SelectionRule, sql

    schemas = {"professors": sql.TableSchema("id", {"id": "string", "item": "string",
                                                    "quantity": "int"})}

    def compiled(options):
        return sql.to_query(sql.check(sql.parse(
            f"SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS({options}) item, COUNT(*) AS n "
            "FROM professors GROUP BY item"), schemas))[0]
    assert compiled("group_selection_strategy = LAPLACE_THRESHOLD").selection is \
        SelectionRule.LAPLACE_THRESHOLD
    public = compiled("group_selection_strategy = PUBLIC_GROUPS, public_groups = ('pen', 'book')")
    assert (public.selection, public.public_partitions) == (SelectionRule.PUBLIC,
                                                            (("pen",), ("book",)))


@pytest.mark.parametrize("options, named", [
    ("group_selection_strategy = PUBLIC_GROUPS", "list the groups with OPTIONS(public_groups"),
    ("group_selection_strategy = LAPLACE_THRESHOLD, selection = truncated_geometric",
     "group_selection_strategy and selection name the same option"),
    ("group_selection_strategy = EXPONENTIAL", "one of ['LAPLACE_THRESHOLD', 'PUBLIC_GROUPS']"),
])
def test_a_group_selection_strategy_that_cannot_run_is_refused_saying_why(options, named):
    from sage_tfx.dp_statistics.aggregation import QueryError, sql

    schemas = {"professors": sql.TableSchema("id", {"id": "string", "item": "string"})}
    with pytest.raises(QueryError, match=named.replace("(", r"\(").replace("[", r"\[")):
        sql.to_query(sql.check(sql.parse(
            f"SELECT WITH DIFFERENTIAL_PRIVACY OPTIONS({options}) item, COUNT(*) AS n "
            "FROM professors GROUP BY item"), schemas))


def test_the_public_groups_join_is_refused_naming_public_groups():
    """The DP clause's public-groups example joins a public table (RIGHT OUTER JOIN ... UNNEST);
    a join here is on the unit column, so the refusal says how to list the groups."""
    from sage_tfx.dp_statistics.aggregation import QueryError, sql

    text = """SELECT WITH DIFFERENTIAL_PRIVACY
  OPTIONS (
    epsilon = 10,
    delta = .01,
    max_groups_contributed = 1,
    group_selection_strategy = PUBLIC_GROUPS
  )
  item,
  AVG(quantity) AS average_quantity
FROM professors
RIGHT OUTER JOIN
(SELECT DISTINCT item FROM UNNEST(['pen', 'pencil', 'book']))
USING (item)
GROUP BY item;"""
    schemas = {"professors": sql.TableSchema("id", {"id": "string", "item": "string",
                                                    "quantity": "int"})}
    with pytest.raises(QueryError, match=r"list them: OPTIONS\(public_groups = \(\.\.\.\)\)"):
        sql.check(sql.parse(text), schemas)


def test_an_epsilon_past_the_selections_range_is_refused_by_name():
    """Planned directly (not through OPTIONS): the selection's calibration would overflow;
    refused, saying so, before anything is charged."""
    from sage_tfx.dp_statistics.aggregation import (Aggregate, AggregationQuery, QueryError,
                                                    SelectionRule, plan)

    query = AggregationQuery(("item",), "id", (Aggregate.count(),), max_partitions_contributed=1,
                             selection=SelectionRule.TRUNCATED_GEOMETRIC)
    with pytest.raises(QueryError, match="partition selection cannot run at epsilon 5e\\+19: its "
                       "calibration computes e\\^epsilon, which overflows"):
        plan(query, 1e20, 0.01)
