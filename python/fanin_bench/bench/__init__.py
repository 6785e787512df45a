"""Benchmarks: each is a `fanin bench <name>` command printing JSON (--json)
and a short human summary; progress goes to stderr."""
