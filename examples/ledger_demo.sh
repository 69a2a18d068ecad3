#!/usr/bin/env bash
# The ledger demo (the README's main job until the taxi example lands): a stream of monthly blocks,
# two pipelines waiting for budget, grants, a denial, a retirement, and the ledger at the end.
set -euo pipefail
out="${DEMO_OUT:-out/ledger-demo}"
rm -rf "$out" && mkdir -p "$out"
store="$out/ledger.sqlite"
ledger() { echo "+ sage-tfx ledger $*" >&2; sage-tfx ledger --store "$store" "$@"; }

ledger init --accounting basic --min-request 0.05
ledger add-block 2024-01 --epsilon 1.0 --delta 1e-6 --start 2024-01-01 --end 2024-02-01
ledger add-block 2024-02 --epsilon 1.0 --delta 1e-6 --start 2024-02-01 --end 2024-03-01
# Two pipelines start waiting: blocks that arrive from now on are split between them (Sage §3.3).
ledger register taxi-duration
ledger register taxi-speed
ledger add-block 2024-03 --epsilon 1.0 --delta 1e-6 --start 2024-03-01 --end 2024-04-01
ledger add-block 2024-04 --epsilon 1.0 --delta 1e-6 --start 2024-04-01 --end 2024-05-01
ledger request --window 2 --epsilon 0.25 --delta 1e-7 --pipeline taxi-duration
ledger request --window 2 --epsilon 0.5 --delta 1e-7 --pipeline taxi-speed
echo "(2024-01 and 2024-02 are left with less than the minimum request: they retire)" >&2
ledger request --blocks 2024-01,2024-02 --epsilon 0.96 --delta 1e-7
echo "(an unallocated request on blocks reserved for the waiting pipelines: denied, exit 3, nothing charged)" >&2
ledger request --blocks 2024-03,2024-04 --epsilon 0.5 --delta 1e-7 || echo "exit code $?" >&2
ledger show
ledger grants
ledger audit
ledger plot --out "$out/ledger.png"
echo "ledger store: $store (open it with any ML Metadata client); plot: $out/ledger.png"
