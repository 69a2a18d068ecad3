"""The durable strategy cache (dp_statistics/matrix/cache.py): a fresh process (here: an empty
in-memory cache) loads the strategy another one selected, without solving; a corrupt, truncated
or foreign file is recomputed, never trusted. Deterministic: no randomness."""
import os
import shutil

import numpy as np
import pytest

from sage_tfx.dp_statistics.matrix import (eigen_design, error, marginals, strategy, union,
                                         workload)


@pytest.fixture
def solves(monkeypatch):
    """Counts Program 1 solves; clears the in-memory cache, as a new process starts with."""
    calls = []
    solve = strategy.optimal_weights

    def counted(*args, **kwargs):
        calls.append(1)
        return solve(*args, **kwargs)
    monkeypatch.setattr(strategy, "optimal_weights", counted)
    strategy._cached_eigen_design.cache_clear()
    yield calls
    strategy._cached_eigen_design.cache_clear()


def _fresh_process():
    strategy._cached_eigen_design.cache_clear()


def test_a_second_process_loads_the_strategy_without_solving(solves, tmp_path):
    target = workload.all_ranges(24)
    first = eigen_design(target, cache_dir=str(tmp_path))
    assert len(solves) >= 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".npz"]  # no temporary file left behind
    _fresh_process()
    solved = len(solves)
    again = eigen_design(workload.all_ranges(24), cache_dir=str(tmp_path))
    assert len(solves) == solved  # loaded, not solved
    assert again.name == first.name and again.duality_gap == first.duality_gap
    assert np.array_equal(again.matrix(), first.matrix())
    # other options or another workload are other keys: solved, not confused with this file
    eigen_design(target, cache_dir=str(tmp_path), separation_group=8)
    eigen_design(workload.cdf(24), cache_dir=str(tmp_path))
    assert len(solves) > solved and len(list(tmp_path.iterdir())) == 3


def test_the_kronecker_strategy_round_trips(solves, tmp_path):
    target = workload.marginals(("a", "b", "c"), (5, 6, 7), (2,))
    first = eigen_design(target, kronecker=True, cache_dir=str(tmp_path))
    _fresh_process()
    solved = len(solves)
    again = eigen_design(target, kronecker=True, cache_dir=str(tmp_path))
    assert len(solves) == solved and again.cell_shape == (5, 6, 7)
    assert all(np.array_equal(a, b) for a, b in zip(again.factors, first.factors))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "non_finite", "wrong_shape"])
def test_a_damaged_file_is_recomputed_and_replaced(solves, tmp_path, damage):
    target = workload.all_ranges(16)
    first = eigen_design(target, cache_dir=str(tmp_path))
    (path,) = tmp_path.iterdir()
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"not a strategy")
    else:
        with np.load(path) as stored:
            fields = dict(stored)
        factor = fields["factor_0"].copy()
        if damage == "non_finite":
            factor[0, 0] = np.nan
        else:
            factor = factor[:, :-1]  # a strategy over 15 cells for a 16-cell workload
        fields["factor_0"] = factor
        with open(path, "wb") as handle:
            np.savez(handle, **fields)
    _fresh_process()
    solved = len(solves)
    again = eigen_design(target, cache_dir=str(tmp_path))
    assert len(solves) > solved  # recomputed
    assert np.allclose(again.matrix(), first.matrix())
    _fresh_process()
    solved = len(solves)
    eigen_design(target, cache_dir=str(tmp_path))
    assert len(solves) == solved  # the recomputed strategy replaced the damaged file


def test_the_environment_variable_chooses_the_directory_or_turns_it_off(solves, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("SAGE_TFX_CACHE", str(tmp_path))
    eigen_design(workload.all_ranges(12))
    assert len(os.listdir(tmp_path / "strategies")) == 1
    monkeypatch.setenv("SAGE_TFX_CACHE", "off")
    _fresh_process()
    solved = len(solves)
    eigen_design(workload.all_ranges(12))
    assert len(solves) > solved


@pytest.fixture
def weight_solves(monkeypatch):
    """Counts OPT_M and OPT_+ weight solves (kept on disk only, never in memory)."""
    calls = []
    for module, name in ((marginals, "_optimal_marginals"), (union, "term_errors")):
        solve = getattr(module, name)

        def counted(*args, _solve=solve, _name=name, **kwargs):
            calls.append(_name)
            return _solve(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("family", ["OPT_M", "OPT_+"])
def test_weighted_strategies_load_without_solving(weight_solves, tmp_path, family):
    build = {"OPT_M": marginals.opt_marginals, "OPT_+": union.opt_union}[family]
    target = workload.marginals(("a", "b", "c", "d"), (3, 4, 5, 2), (0, 1, 2))
    first = build(target, cache_dir=str(tmp_path))
    assert len(weight_solves) == 1 and len(list(tmp_path.iterdir())) == 1
    again = build(target, cache_dir=str(tmp_path))
    assert len(weight_solves) == 1  # loaded, not solved
    assert np.array_equal(again.weights, first.weights) and again.name == first.name
    assert again.duality_gap == first.duality_gap
    assert error.unit_rmse(target, again) == error.unit_rmse(target, first)
    # the same domain with other terms is another key
    build(workload.marginals(("a", "b", "c", "d"), (3, 4, 5, 2), (1,)), cache_dir=str(tmp_path))
    assert len(weight_solves) == 2


@pytest.mark.parametrize("family", ["OPT_M", "OPT_+"])
def test_a_removed_cache_directory_is_written_again(weight_solves, tmp_path, family):
    """Not remembered in memory: a pipeline root removed and run again within one process
    gets its strategy file again (the neighbouring-components test runs two pipelines so)."""
    build = {"OPT_M": marginals.opt_marginals, "OPT_+": union.opt_union}[family]
    target = workload.marginals(("a", "b", "c"), (3, 4, 5), (0, 1))
    build(target, cache_dir=str(tmp_path / "root"))
    shutil.rmtree(tmp_path / "root")
    build(target, cache_dir=str(tmp_path / "root"))
    assert len(list((tmp_path / "root").iterdir())) == 1


@pytest.mark.parametrize("family", ["OPT_M", "OPT_+"])
@pytest.mark.parametrize("damage", ["wrong_length", "negative", "non_finite"])
def test_damaged_weights_are_recomputed(weight_solves, tmp_path, family, damage):
    build = {"OPT_M": marginals.opt_marginals, "OPT_+": union.opt_union}[family]
    target = workload.marginals(("a", "b", "c"), (3, 4, 5), (0, 1, 2))
    first = build(target, cache_dir=str(tmp_path))
    (path,) = tmp_path.iterdir()
    with np.load(path) as stored:
        fields = dict(stored)
    weights = fields["weights"].copy()
    if damage == "wrong_length":
        weights = weights[:-1]
    elif damage == "negative":
        weights[0] = -1.0
    else:
        weights[0] = np.inf
    fields["weights"] = weights
    with open(path, "wb") as handle:
        np.savez(handle, **fields)
    again = build(target, cache_dir=str(tmp_path))
    assert len(weight_solves) == 2  # recomputed, not trusted
    assert np.allclose(again.weights, first.weights)
