"""Drivers of the packet-level simulator fanin-sim (crates/fanin-sim): `fanin sim allreduce` (fanin's tree vs
ring allreduce, :mod:`.allreduce`), `fanin sim goat` (a GOAT study point at packet level, :mod:`.goat`) and the
plots of their CSV (:mod:`.plots`). :mod:`.command` is the `fanin sim` sub-parser."""
