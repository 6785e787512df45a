# The two commands the README promises:
#   make demo   set everything up, then run the local demo
#   make test   set everything up, then run the whole test suite
.PHONY: setup demo test bench-quick clean

setup:
	scripts/setup.sh

demo: setup
	fanin demo

test: setup
	scripts/test.sh

# A quick pass over the benchmarks (each prints JSON; see docs/results.md).
bench-quick: setup
	python3 -m pip install -q -r requirements-bench.txt
	fanin bench allreduce --quick --json
	fanin bench gloo-compare --quick --json
	fanin bench epp-sweep --quick --json
	fanin bench window-sweep --quick --json

clean:
	cargo clean
	rm -rf fuzz/target fuzz/corpus-run out
