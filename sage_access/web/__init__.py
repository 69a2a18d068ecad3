"""`sage-tfx ledger serve`: a read-only web view of the ledger (app.py builds it, static/ holds the
page; plotly.js comes from the pinned plotly wheel, so nothing is fetched from a CDN)."""
