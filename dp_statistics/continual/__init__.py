"""DP-SQLP continual release over streams (issue 19): docs/streaming.md."""
