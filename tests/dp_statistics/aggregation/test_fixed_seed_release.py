"""A fixed-seed release through `dp_aggregate()`, digested bit for bit: a change that should
not move a released value (a refactoring of the plan, of the selection's threshold, of when the
stated accuracy is computed) must leave these digests as they are.

Noise: `seeded_noise` (the OpenDP law and scale from numpy seeded with 0) and the contribution
sampling seeded with 1; the selection is Laplace thresholding, whose noise is one of those
seeded draws; Gaussian noise, so the PLD plan's lambda is above 1 (2.48 here)."""
import hashlib

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sage_tfx import release
from sage_tfx.dp_statistics.aggregation import frontend, local, sql
from sage_tfx.randomness import secret_rng
from sage_tfx.sage_access import BlockLedger
from sage_tfx.sage_access.ledger import BlockIds

SQL = ("SELECT WITH ANONYMIZATION OPTIONS(privacy_unit_column = uid, max_groups_contributed = 2, "
       "selection = laplace_threshold, noise = gaussian) area, ANON_COUNT(*) AS n, "
       "ANON_COUNT(DISTINCT uid) AS units, ANON_SUM(fare, 0, 30) AS total, "
       "ANON_AVG(fare, 0, 30) AS mean, ANON_COUNT(fare) AS fares, ANON_STDDEV(fare, 0, 30) AS sd, "
       "ANON_NTILE(fare, 4, 0, 30) AS cut FROM t GROUP BY area")
# sha256 of the released table's bytes (column names, then each column's float64 values), as
# released by main at commit 02d4102, then once more when the lattice term of the noise scale
# became a public constant (mechanisms/additive.py MAX_COORDINATES: every scale moved by a
# relative 2^-14 or less; the lattice 50 digits below the sensitivity), then when AVG's count
# got 41/100 of its budget (budget.MEAN_COUNT_FRACTION; `mean` and `fares`, its count, move)
# and its mean was shrunk towards the midpoint, its stated error that of the shrunk mean
# (aggregators.mean_shrinkage; issue 48), and when integer keys got their codes by value
# (local.factorize: another labelling of the partitions, so the seeded sampling picks other rows).
TABLE_DIGEST = "f51c8f927f69f3908d43bb819c8066e5695655467b48410b1052ae29db20c732"
WITH_INTERVALS_DIGEST = "7f1361a1b368b199489ab8e1c586471decdfc902b5fe39d93a25c97419d8e85b"


def frame() -> pd.DataFrame:
    rng = np.random.default_rng(3)
    return pd.DataFrame({"uid": rng.integers(0, 3000, 20000).astype(str),
                         "area": rng.integers(1, 5, 20000), "fare": rng.uniform(0, 30, 20000)})


def digest(table: pd.DataFrame) -> str:
    hashed = hashlib.sha256()
    for column in table.columns:
        hashed.update(column.encode())
        hashed.update(np.ascontiguousarray(table[column].to_numpy(np.float64)).tobytes())
    return hashed.hexdigest()


def released(store_path, intervals: bool) -> pd.DataFrame:
    data = frame()
    schema = sql.TableSchema("uid", {"uid": "string", "area": "int", "fare": "float"})
    arrow = pa.Table.from_pandas(data, preserve_index=False).schema
    planned = frontend.plan_query(sql.parse(SQL), {"t": schema}, {"t": arrow}, 1.0, 1e-6)
    ledger = BlockLedger.create(store_path)
    ledger.add_block("b1", 5.0, 1e-5)
    grant = release.charge(ledger, planned.release_plan("test", SQL), BlockIds(["b1"])).grant
    return frontend.dp_aggregate(data, SQL, grant, ledger, intervals=intervals).table


@pytest.mark.parametrize("intervals", [False, True])
def test_a_fixed_seed_release_is_bit_for_bit_what_it_was(intervals, tmp_path, seeded_noise,
                                                         monkeypatch):
    monkeypatch.setattr(local, "secret_rng", lambda seed=None: secret_rng(1))
    table = released(str(tmp_path / "ledger.sqlite"), intervals)
    assert len(table) == 4  # every area kept
    assert digest(table) == (WITH_INTERVALS_DIGEST if intervals else TABLE_DIGEST)
