"""The adaptive matrix mechanism's results (Li & Miklau, PVLDB 2012), measured on our code.

    python benchmarks/matrix_mechanism.py [--json] [--quick]

* Example 4 (8 cells, Fig. 1's workload, epsilon 0.5, delta 1e-4): RMSE per query under the
  analytic Gaussian for the workload as strategy, identity, wavelet, Eigen-Design and the SVD
  bound; beside it the paper's figures. The paper's constant differs from ours (its figures are
  sqrt(log2(2/delta)) / epsilon * ||A|| sqrt(trace(W^T W (A^T A)^-1)), a total and not a mean,
  with the classical Gaussian's log), so compare the ratios to the identity, which are free of it.
  The paper's workload-as-strategy figure takes trace = m (as if W had full rank); W has rank 4,
  and with the pseudo-inverse (the least-squares estimate) it is half of that.
* Table 2 (2048 cells): the factor by which Eigen-Design reduces the error of identity, wavelet
  and hierarchical (H2) strategies, and its ratio bound / Eigen-Design, for permuted ranges,
  1- and 2-way range marginals over 8 x 16 x 16 (the paper's census shape), the CDF, and 2048
  predicate queries drawn uniformly; with each selection's wall-clock seconds.
* §5.2: eigen-query separation (groups of 16) and principal vectors (6%, 10%, 25%) on all
  ranges and on all 2-way marginals of 8 x 16 x 16: error relative to full Eigen-Design and to
  the bound, and selection seconds.
--quick runs the same at 256 cells (4 x 8 x 8), for a smoke test.
Errors do not depend on the data or the noise draw (closed forms, error.py), so nothing here is
random except which ranges are permuted and which predicates are drawn (seed 1).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import numpy as np

from sage_tfx.dp_statistics.matrix import convex, error, strategy, workload
from sage_tfx.dp_statistics.matrix.marginals import opt_marginals
from sage_tfx.dp_statistics.matrix.union import opt_union
from sage_tfx.dp_statistics.matrix.workload import Block, BlockKind

EPSILON, DELTA = 0.5, 1e-4
EXAMPLE4_WORKLOAD = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0],
                              [0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0, 0],
                              [0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1],
                              [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, -1, -1, -1, -1]], float)
PAPER_EXAMPLE4 = {"workload": 47.78, "identity": 45.36, "wavelet": 34.62,
                  "eigen_design": 29.79, "lower_bound": 29.18}
# Table 2, workload error: Eigen-Design's reduction over the best / worst competitor and the
# ratio bound / Eigen-Design (the paper's competitors include Fourier and DataCube).
PAPER_TABLE2 = {
    "permuted_range": {"best": 9.62, "worst": 13.16, "bound_ratio": 0.99,
                       "competitors": "wavelet/hierarchical"},
    "range_marginals_1way": {"best": 1.30, "worst": 7.69, "bound_ratio": 0.98,
                             "competitors": "datacube/fourier"},
    "range_marginals_2way": {"best": 1.63, "worst": 3.23, "bound_ratio": 0.95,
                             "competitors": "hierarchical/fourier"},
    "cdf": {"best": 1.01, "worst": 1.01, "bound_ratio": 0.80,
            "competitors": "wavelet/hierarchical"},
    "predicate": {"best": 1.39, "worst": 1.94, "bound_ratio": 1.00,
                  "competitors": "wavelet/fourier"},
}


def timed_eigen_design(target, **options):
    start = time.perf_counter()
    chosen = strategy.eigen_design(target, **options)
    return chosen, time.perf_counter() - start


def example4() -> dict:
    target = workload.explicit(EXAMPLE4_WORKLOAD)
    chosen = {"workload": strategy.workload_as_strategy(target),
              "identity": strategy.identity(target), "wavelet": strategy.wavelet(target),
              "eigen_design": strategy.eigen_design(target)}
    rmse = {name: error.expected_rmse(target, s, EPSILON, DELTA) for name, s in chosen.items()}
    rmse["lower_bound"] = error.svd_lower_bound_rmse(target, EPSILON, DELTA)
    paper_constant = math.sqrt(math.log2(2 / DELTA)) / EPSILON * math.sqrt(
        target.query_count)
    return {
        "epsilon": EPSILON, "delta": DELTA, "rmse_per_query": rmse,
        "ratio_to_identity": {k: v / rmse["identity"] for k, v in rmse.items()},
        "in_paper_units": {k: v / error.expected_rmse(target, chosen["identity"], EPSILON, DELTA)
                           * error.unit_rmse(target, chosen["identity"]) * paper_constant
                           for k, v in rmse.items()},
        "paper": PAPER_EXAMPLE4,
        "paper_ratio_to_identity": {k: v / PAPER_EXAMPLE4["identity"]
                                    for k, v in PAPER_EXAMPLE4.items()},
    }


def table2_workloads(cells: int, shape: tuple[int, int, int], rng) -> dict:
    names = ("a", "b", "c")
    return {
        "permuted_range": workload.permuted_ranges(cells, rng),
        "range_marginals_1way": workload.range_marginals(names, shape, (1,)),
        "range_marginals_2way": workload.range_marginals(names, shape, (2,)),
        "cdf": workload.cdf(cells),
        "predicate": workload.predicates(cells, cells, rng),
    }


def table2(cells: int, shape, rng) -> dict:
    rows = {}
    for name, target in table2_workloads(cells, shape, rng).items():
        chosen, seconds = timed_eigen_design(target)
        eigen_error = error.unit_rmse(target, chosen)
        competitors = {"identity": strategy.identity(target), "wavelet": strategy.wavelet(target),
                       "hierarchical": strategy.hierarchical(target)}
        rows[name] = {
            "cells": target.cells, "queries": target.query_count,
            "reduction_over": {k: error.unit_rmse(target, s) / eigen_error
                               for k, s in competitors.items()},
            "bound_ratio": error.svd_bound_unit_rmse(target) / eigen_error,
            "eigen_design_rmse": error.expected_rmse(target, chosen, EPSILON, DELTA),
            "duality_gap": chosen.duality_gap, "selection_seconds": seconds,
            "paper": PAPER_TABLE2[name]}
    return rows


def speedups(cells: int, shape) -> dict:
    results = {}
    targets = {"all_ranges": workload.all_ranges(cells),
               "marginals_2way": workload.marginals(("a", "b", "c"), shape, (2,))}
    variants = {"full": {}, "separation_16": {"separation_group": 16},
                "principal_6pct": {"principal_fraction": 0.06},
                "principal_10pct": {"principal_fraction": 0.10},
                "principal_25pct": {"principal_fraction": 0.25}}
    for name, target in targets.items():
        bound = error.svd_bound_unit_rmse(target)
        rows = {}
        for variant, options in variants.items():
            chosen, seconds = timed_eigen_design(target, **options)
            rows[variant] = {"unit_rmse": error.unit_rmse(target, chosen),
                             "selection_seconds": seconds}
        for row in rows.values():
            row["over_full"] = row["unit_rmse"] / rows["full"]["unit_rmse"]
            row["over_bound"] = row["unit_rmse"] / bound
        results[name] = rows
    return results


def kronecker() -> dict:
    """Product workloads over 10^6 cells: Eigen-Design per attribute, cycled (OPT_(x))."""
    targets = {"marginals_2way_100^3": workload.marginals(("a", "b", "c"), (100,) * 3, (2,)),
               "ranges_2d_1000^2": workload.ranges_2d(1000, 1000),
               "range_marginals_2way_100^3": workload.range_marginals(("a", "b", "c"),
                                                                      (100,) * 3, (2,))}
    rows = {}
    for name, target in targets.items():
        chosen, seconds = timed_eigen_design(target)
        eigen_error = error.unit_rmse(target, chosen)
        try:
            bound_ratio = error.svd_bound_unit_rmse(target) / eigen_error
        except ValueError:  # non-commuting factors: no closed-form bound at this size
            bound_ratio = None
        if name.startswith("marginals"):
            start = time.perf_counter()
            marginal = opt_marginals(target)
            rows[f"{name} OPT_M"] = {
                "unit_rmse": error.unit_rmse(target, marginal), "eigen_design": eigen_error,
                "bound_ratio": error.svd_bound_unit_rmse(target) / error.unit_rmse(
                    target, marginal), "duality_gap": marginal.duality_gap,
                "selection_seconds": time.perf_counter() - start}
        rows[name] = {"cells": target.cells, "queries": target.query_count,
                      "reduction_over": {s.name: error.unit_rmse(target, s) / eigen_error
                                         for s in (strategy.identity(target),
                                                   strategy.wavelet(target),
                                                   strategy.hierarchical(target))},
                      "bound_ratio": bound_ratio, "selection_seconds": seconds}
    return rows


# The HDMM authors' 1D comparison (McKenna et al., VLDB 2018, journal experiments), as committed
# in their reference implementation: github.com/dpcomp-org/hdmm, experiments/journal/oned.csv at
# commit 08c1ba46f071f1de2569f8388ef5d823b2fd7503 (made by experiments/journal/oned.py with
# approx = True: RMSE per query with L2 sensitivity and unit noise, our error.unit_rmse).
# Columns: Identity, H2, Wavelet, YuanConvex (Yuan et al.'s convex optimum of the (eps,
# delta) matrix mechanism, HDMM's strongest 1D strategy there), SVDB.
HDMM_ONED = {
    (128, "all-range"): (6.582805886043833, 3.4252515061976374, 3.10127744880041,
                         2.599181805478603, 2.5734725086329013),
    (128, "prefix"): (8.031189202104505, 2.8099401583796952, 2.794473480147913,
                      2.3120911713428396, 2.2544140344498174),
    (128, "width32"): (5.656854249492381, 3.440445408079211, 3.0443986930199944,
                       2.3000442155559924, 2.200986867973526),
    (256, "all-range"): (9.273618495495704, 3.835363996450649, 3.505013319547386,
                         2.902169221655514, 2.8763585581409346),
    (256, "prefix"): (11.335784048754634, 3.1022372719717644, 3.085059705060675,
                      2.528223367467486, 2.4714459649021547),
    (256, "width32"): (5.656854249492381, 3.6545452907381706, 3.1994201134736904,
                       2.357662276180983, 2.3037582987210774),
    (512, "all-range"): (13.089435944047908, 4.244976951040033, 3.911176097873472,
                         3.209922792933631, 3.1832074764205527),
    (512, "prefix"): (16.015617378046965, 3.3943522295168544, 3.3761899757628275,
                      2.7515761131831584, 2.6900647820550825),
    (512, "width32"): (5.656854249492381, 3.8563190467438533, 3.367176175660251,
                       2.3793286548250077, 2.3503501487290936),
    (1024, "all-range"): (18.49324200890693, 4.654169977877171, 4.318521525649876,
                          3.568100282990444, 3.4923407505042805),
    (1024, "prefix"): (22.638462845343543, 3.6861586552943884, 3.667399174319099,
                       3.0652911247160457, 2.9095843877394243),
    (1024, "width32"): (5.656854249492381, 4.047054465471033, 3.5315036591976234,
                        2.388717141433618, 2.3725505668946116),
    (2048, "all-range"): (26.14064523559687, 5.063062655737136, 4.726435434267867,
                          3.850227509882645, 3.802768110018751),
    (2048, "prefix"): (32.00781154655844, 3.977631302415767, 3.958484138159224,
                       5.001766132120014, 3.1296081568819774),
    (2048, "width32"): (5.656854249492381, 4.228423047455345, 3.68925020933523,
                        3.5773968585007476, 2.383387585115259),
}
HDMM_COLUMNS = ("identity", "hierarchical", "wavelet", "yuan_convex", "svd_bound")
HDMM_WORKLOADS = {"all-range": workload.all_ranges, "prefix": workload.cdf,
                  "width32": lambda n: workload.width_ranges(n, 32)}


# Their high-dimensional comparison on the adult domain (14 attributes; 1.1e14 cells), from
# experiments/journal/hderror.csv at the same commit (compute_strategies.py, approx = True, RMSE
# per query as above) for OPT_(x) ("kron"), OPT_+ ("union") and OPT_M ("marg"); the workloads
# as experiments/journal/benchmarks.py defines them (stored at commit 54786e0 only): 1 = all 0-
# to 3-way marginals, 2 = all 2-way products of Prefix (first five attributes) or Identity.
ADULT_DOMAIN = (100, 100, 100, 99, 85, 42, 16, 15, 9, 7, 6, 5, 2, 2)
HDMM_ADULT = {"adult 1": {"kron": 19.0457, "union": 213.2232, "marg": 11.2938},
              "adult 2": {"kron": 24.9534, "union": 148.7992, "marg": 68.3233}}


def adult_workloads() -> dict:
    names = tuple(f"a{i}" for i in range(len(ADULT_DOMAIN)))
    kinds = [BlockKind.PREFIX] * 5 + [BlockKind.IDENTITY] * (len(ADULT_DOMAIN) - 5)
    pairs = tuple(tuple(Block(kinds[i] if i in pair else BlockKind.TOTAL, size)
                        for i, size in enumerate(ADULT_DOMAIN))
                  for pair in itertools.combinations(range(len(ADULT_DOMAIN)), 2))
    return {"adult 1": workload.marginals(names, ADULT_DOMAIN, (0, 1, 2, 3)),
            "adult 2": workload.Workload(names, ADULT_DOMAIN, pairs)}


def hdmm_adult() -> dict:
    """Our Kronecker Eigen-Design, OPT_M and OPT_+ on HDMM's adult workloads beside its three
    templates (all: RMSE per query, L2 sensitivity, unit noise)."""
    rows = {}
    for name, target in adult_workloads().items():
        chosen, seconds = timed_eigen_design(target, kronecker=True)
        ours = error.unit_rmse(target, chosen)
        start = time.perf_counter()
        marginal = opt_marginals(target)
        marginal_seconds = time.perf_counter() - start
        start = time.perf_counter()
        union = opt_union(target)
        union_seconds = time.perf_counter() - start
        marg, plus = error.unit_rmse(target, marginal), error.unit_rmse(target, union)
        rows[name] = {"queries": target.query_count, "eigen_design_kronecker": ours,
                      "opt_m": marg, "opt_m_gap": marginal.duality_gap, "opt_plus": plus,
                      "hdmm": HDMM_ADULT[name], "over_hdmm_kron": ours / HDMM_ADULT[name]["kron"],
                      "over_hdmm_marg": ours / HDMM_ADULT[name]["marg"],
                      "opt_m_over_hdmm_marg": marg / HDMM_ADULT[name]["marg"],
                      "opt_plus_over_hdmm_union": plus / HDMM_ADULT[name]["union"],
                      "selection_seconds": seconds, "opt_m_seconds": marginal_seconds,
                      "opt_plus_seconds": union_seconds}
    return rows


def hdmm_oned(sizes=(128, 256, 512, 1024, 2048), convex_up_to: int = convex.MAX_CELLS) -> dict:
    """Our strategies on HDMM's 1D workloads beside the figures its authors committed."""
    rows = {}
    for (cells, name), published in HDMM_ONED.items():
        if cells not in sizes:
            continue
        target = HDMM_WORKLOADS[name](cells)
        chosen, seconds = timed_eigen_design(target)
        ours = {"identity": error.unit_rmse(target, strategy.identity(target)),
                "hierarchical": error.unit_rmse(target, strategy.hierarchical(target)),
                "wavelet": error.unit_rmse(target, strategy.wavelet(target)),
                "eigen_design": error.unit_rmse(target, chosen),
                "svd_bound": error.svd_bound_unit_rmse(target)}
        row = {"ours": ours, "hdmm": dict(zip(HDMM_COLUMNS, published)),
               "eigen_design_over_yuan_convex": ours["eigen_design"] / published[3],
               "selection_seconds": seconds}
        if cells <= convex_up_to:
            start = time.perf_counter()
            optimum = convex.convex_optimum(target)
            ours["convex_optimum"] = error.unit_rmse(target, optimum)
            row.update(convex_gap=optimum.duality_gap,
                       convex_seconds=time.perf_counter() - start,
                       eigen_design_over_convex=ours["eigen_design"] / ours["convex_optimum"],
                       convex_over_yuan_convex=ours["convex_optimum"] / published[3])
        rows[f"{name} {cells}"] = row
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="256 cells instead of 2048")
    parser.add_argument("--only", choices=["example4", "table2", "speedups", "kronecker",
                                           "hdmm"],
                        help="run one part")
    args = parser.parse_args(argv)
    # Selection times are the point here: no strategy comes from the disk cache (cache.py).
    os.environ["SAGE_TFX_CACHE"] = "off"
    cells, shape = (256, (4, 8, 8)) if args.quick else (2048, (8, 16, 16))
    rng = np.random.default_rng(1)
    parts = {"example4": example4, "table2": lambda: table2(cells, shape, rng),
             "speedups": lambda: speedups(cells, shape), "kronecker": kronecker,
             "hdmm": lambda: {"oned": hdmm_oned((128, 256) if args.quick
                                                else (128, 256, 512, 1024, 2048)),
                              "adult": hdmm_adult()}}
    result = {name: run() for name, run in parts.items() if args.only in (None, name)}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    _print_table(result, cells)
    return 0


def _print_table(result: dict, cells: int) -> None:
    ex = result.get("example4")
    if ex:
        _print_example4(ex)
    for name, row in result.get("table2", {}).items():
        if name == next(iter(result["table2"])):
            print(f"Table 2 at {cells} cells: reduction over identity / wavelet / "
                  "hierarchical, bound ratio, selection s (paper best/worst, bound ratio)")
        over, paper = row["reduction_over"], row["paper"]
        print(f"  {name:21s} {over['identity']:6.2f} {over['wavelet']:6.2f} "
              f"{over['hierarchical']:6.2f}  {row['bound_ratio']:.3f}  "
              f"{row['selection_seconds']:5.1f}s  ({paper['best']}/{paper['worst']} "
              f"{paper['competitors']}, {paper['bound_ratio']})")
    for name, rows in result.get("speedups", {}).items():
        for variant, row in rows.items():
            print(f"  §5.2 {name:15s} {variant:16s} over full {row['over_full']:.3f}, over "
                  f"bound {row['over_bound']:.3f}, {row['selection_seconds']:6.1f}s")
    for name, row in result.get("kronecker", {}).items():
        if "cells" not in row:  # OPT_M beside the Kronecker design
            print(f"  {name}: {row['unit_rmse']:.4f} (Eigen-Design {row['eigen_design']:.4f}), "
                  f"bound ratio {row['bound_ratio']:.4f}, {row['selection_seconds']:.1f}s")
            continue
        print(f"  kronecker {name}: {row['cells']} cells, reduction over "
              f"{ {k: round(v, 2) for k, v in row['reduction_over'].items()} }, bound ratio "
              f"{row['bound_ratio']}, {row['selection_seconds']:.1f}s")
    for name, row in result.get("hdmm", {}).get("adult", {}).items():
        print(f"  HDMM {name}: {row['queries']} queries, Kronecker Eigen-Design "
              f"{row['eigen_design_kronecker']:.4f}; HDMM {row['hdmm']} "
              f"(ours / kron {row['over_hdmm_kron']:.3f}, / marg {row['over_hdmm_marg']:.3f}), "
              f"{row['selection_seconds']:.1f}s")
    for name, row in result.get("hdmm", {}).get("oned", {}).items():
        ours, hdmm = row["ours"], row["hdmm"]
        print(f"  HDMM 1D {name:15s} ours (HDMM's): identity {ours['identity']:.4f} "
              f"({hdmm['identity']:.4f}), H2 {ours['hierarchical']:.4f} "
              f"({hdmm['hierarchical']:.4f}), wavelet {ours['wavelet']:.4f} "
              f"({hdmm['wavelet']:.4f}), bound {ours['svd_bound']:.4f} "
              f"({hdmm['svd_bound']:.4f}); Eigen-Design {ours['eigen_design']:.4f} vs "
              f"YuanConvex {hdmm['yuan_convex']:.4f} "
              f"({row['eigen_design_over_yuan_convex']:.3f}), {row['selection_seconds']:.1f}s")


def _print_example4(ex: dict) -> None:
    print(f"Example 4 (eps {EPSILON}, delta {DELTA}): RMSE per query, ratio to identity "
          f"(paper's ratio)")
    for name, value in ex["rmse_per_query"].items():
        print(f"  {name:13s} {value:8.3f}  {ex['ratio_to_identity'][name]:.3f} "
              f"({ex['paper_ratio_to_identity'][name]:.3f})")


if __name__ == "__main__":
    sys.exit(main())
