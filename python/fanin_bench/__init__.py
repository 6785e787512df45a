"""fanin_bench: what measures fanin rather than what fanin is. The benchmark harnesses (`fanin bench`,
:mod:`fanin_bench.bench`), the network-namespace testbed (`fanin testbed`, :mod:`fanin_bench.testbed`) and the
drivers of the packet-level simulator (`fanin sim`, :mod:`fanin_bench.sim`).

It imports fanin; fanin never imports it at module level (python/tests/test_package.py checks), so the library
carries none of the harnesses' dependencies (matplotlib, tqdm, torch for the baselines) and `fanin.cli` hands
these three commands to :func:`fanin_bench.cli.main` only when one of them runs. Nothing is imported here.
"""
