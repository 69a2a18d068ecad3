"""`sage-tfx ledger serve`: a read-only web view of the ledger (app.py builds it, static/ holds the
page; plotly.js's basic bundle, pinned in package-lock.json, is installed beside them by
`make web`, so nothing is fetched from a CDN)."""
