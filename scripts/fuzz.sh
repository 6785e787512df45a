#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer) of every target in fuzz/, each for a
# bounded time.
#
#   scripts/fuzz.sh [seconds_per_target] [target ...]
#
# seconds_per_target defaults to 20; targets default to every [[bin]] of
# fuzz/Cargo.toml. Each target runs on a fresh scratch copy of its committed
# seed corpus (fuzz/corpus/<t> -> fuzz/corpus-run/<t>, gitignored), so the
# committed corpus never changes. Prints one line per target and a closing
# "fuzz: N passed, N failed" line; exits 1 if a target crashed, hung, ran out
# of memory or did not build. A crashing input is kept in fuzz/artifacts/<t>/
# and the line says how to replay it.
#
# Needs cargo (rustup stable by default) and a C++ compiler (libfuzzer-sys
# builds libFuzzer from source). Where fuzzing cannot run at all (no cargo, no
# C++ compiler, a rustc without SanitizerCoverage, not Linux/macOS) it prints
# why and exits 0, or 2 when FUZZ_STRICT=1.
#
# Environment:
#   FUZZ_TOOLCHAIN   rustup toolchain (default: stable, then nightly)
#   FUZZ_SANITIZER   "address" adds AddressSanitizer (needs nightly; the
#                    parsers are safe Rust, so the default is none)
#   FUZZ_TARGET_DIR  cargo target dir (default fuzz/target)
#   FUZZ_ARGS        extra libFuzzer flags, e.g. "-max_len=65507 -jobs=2"
#   FUZZ_STRICT=1    treat "cannot fuzz here" as a failure (exit 2)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fuzz="$root/fuzz"
run="$fuzz/corpus-run"
secs=${1:-20}
[ $# -gt 0 ] && shift
case $secs in '' | *[!0-9]* | 0) echo "usage: $0 [seconds_per_target>0] [target ...]" >&2; exit 64 ;; esac

t_start=$SECONDS

# Targets: the [[bin]] names of fuzz/Cargo.toml, or the ones asked for.
all_targets=$(awk '/^\[\[bin\]\]/ {b=1; next} /^\[/ {b=0} b && /^name *=/ {gsub(/.*= *"|".*/, ""); print}' "$fuzz/Cargo.toml")
if [ $# -gt 0 ]; then
    targets="$*"
    for t in $targets; do
        grep -qx "$t" <<<"$all_targets" || { echo "fuzz: unknown target '$t' (have: $(echo $all_targets))" >&2; exit 64; }
    done
else
    targets=$all_targets
fi
n_targets=$(wc -w <<<"$targets")

skip() {
    echo "fuzz: SKIPPED, cannot fuzz on this machine: $*"
    echo "fuzz: 0 passed, 0 failed, $n_targets skipped"
    if [ "${FUZZ_STRICT:-0}" = 1 ]; then exit 2; fi
    exit 0
}

# --- can we fuzz here? ------------------------------------------------------
case $(uname -s) in Linux | Darwin) ;; *) skip "libFuzzer supports Linux and macOS, this is $(uname -s)" ;; esac
command -v cargo >/dev/null 2>&1 || skip "cargo not found on PATH"
cxx=${CXX:-}
if [ -z "$cxx" ]; then
    for c in c++ g++ clang++; do command -v $c >/dev/null 2>&1 && { cxx=$c; break; }; done
fi
[ -n "$cxx" ] && command -v "${cxx%% *}" >/dev/null 2>&1 || skip "no C++ compiler (c++, g++ or clang++; Debian: apt-get install g++) to build libFuzzer"

# Toolchain: the first of FUZZ_TOOLCHAIN / stable / nightly that rustup has;
# plain cargo where there is no rustup.
sanitizer=${FUZZ_SANITIZER:-none}
case $sanitizer in none) candidates="stable nightly" ;; address) candidates="nightly" ;;
    *) echo "fuzz: FUZZ_SANITIZER must be none or address" >&2; exit 64 ;; esac
tc=""
plus=()
if command -v rustup >/dev/null 2>&1; then
    for c in ${FUZZ_TOOLCHAIN:-$candidates}; do
        if rustc "+$c" -V >/dev/null 2>&1; then tc=$c; break; fi
    done
    if [ -z "$tc" ] && [ -n "${FUZZ_TOOLCHAIN:-}" ]; then
        echo "fuzz: FUZZ_TOOLCHAIN=$FUZZ_TOOLCHAIN is not installed (rustup toolchain install $FUZZ_TOOLCHAIN)" >&2
        exit 64
    fi
    [ -n "$tc" ] || skip "none of the rustup toolchains '${FUZZ_TOOLCHAIN:-$candidates}' is installed (rustup toolchain install ${FUZZ_TOOLCHAIN:-stable})"
    plus=("+$tc")
else
    tc=$(rustc -V 2>/dev/null) || skip "rustc not found"
fi
host=$(rustc "${plus[@]}" -vV | sed -n 's/^host: //p')

# SanitizerCoverage as cargo-fuzz sets it up: 8-bit edge counters + PC table
# for libFuzzer's coverage, compare tracing so it can solve magic numbers.
rustflags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
rustflags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
rustflags+=" -Cllvm-args=-sanitizer-coverage-pc-table"
rustflags+=" -Cllvm-args=-sanitizer-coverage-trace-compares"
rustflags+=" --cfg fuzzing -Cforce-frame-pointers=yes"
if [ "$sanitizer" = address ]; then
    rustflags+=" -Zsanitizer=address"
fi

mkdir -p "$run"
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
echo 'pub fn f(x: u16) -> bool { x == 0xFA17 }' >"$probe_dir/probe.rs"
# shellcheck disable=SC2086
if ! rustc "${plus[@]}" --crate-type=lib --target "$host" $rustflags -o "$probe_dir/libprobe.rlib" "$probe_dir/probe.rs" >"$probe_dir/probe.log" 2>&1; then
    skip "rustc ($tc) rejects the SanitizerCoverage flags: $(head -n 3 "$probe_dir/probe.log" | tr '\n' ' ')"
fi

# --- build ------------------------------------------------------------------
target_dir=${FUZZ_TARGET_DIR:-$fuzz/target}
build_log="$run/build.log"
t_build=$SECONDS
# --target keeps RUSTFLAGS off build scripts and proc macros (thiserror),
# which must not be instrumented. CARGO_ENCODED_RUSTFLAGS would win over
# RUSTFLAGS, so drop it.
if ! env -u CARGO_ENCODED_RUSTFLAGS RUSTFLAGS="$rustflags" CXX="$cxx" \
    cargo "${plus[@]}" build --release --bins \
        --manifest-path "$fuzz/Cargo.toml" --target "$host" --target-dir "$target_dir" \
        >"$build_log" 2>&1; then
    echo "fuzz: BUILD FAILED ($tc, $host); last lines of $build_log:"
    tail -n 40 "$build_log" | sed 's/^/    /'
    echo "fuzz: 0 passed, $n_targets failed"
    exit 1
fi
build_secs=$((SECONDS - t_build))
bin_dir="$target_dir/$host/release"

# --- run --------------------------------------------------------------------
passed=0
failed=0
backstop=""
if command -v timeout >/dev/null 2>&1; then backstop="timeout -k 10 $((secs * 2 + 60))"; fi
for t in $targets; do
    corpus="$run/$t"
    log="$run/$t.log"
    artifacts="$fuzz/artifacts/$t/"
    rm -rf "$corpus"
    mkdir -p "$corpus" "$artifacts"
    seeds=0
    if [ -d "$fuzz/corpus/$t" ]; then
        cp -R "$fuzz/corpus/$t/." "$corpus/"
        seeds=$(find "$corpus" -type f | wc -l | tr -d ' ')
    fi
    # -use_value_profile lets compare tracing steer 1- and 2-byte compares
    # too (the magic); -timeout turns a hang into a failure. The outer timeout
    # is a backstop if libFuzzer itself stops responding.
    rc=0
    # shellcheck disable=SC2086
    $backstop "$bin_dir/$t" "$corpus" \
        -max_total_time="$secs" -use_value_profile=1 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$artifacts" ${FUZZ_ARGS:-} \
        >"$log" 2>&1 || rc=$?
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    last=$(grep -E '^#[0-9]+[[:space:]]+[A-Z]+[[:space:]]+cov: ' "$log" | tail -n 1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\)\/.*/\1/p' <<<"$last")
    stats="${runs:-?} runs (${speed:-?}/s), cov ${cov:-?}, ft ${ft:-?}, corpus $seeds->${corp:-?}"
    if [ "$rc" = 0 ] && grep -q '^Done [0-9]* runs' "$log"; then
        passed=$((passed + 1))
        printf 'fuzz: %-14s ok    %s\n' "$t" "$stats"
    else
        failed=$((failed + 1))
        case $rc in 124 | 137) why="no end after $((secs * 2 + 60))s" ;; *) why="exit $rc" ;; esac
        crash=$(grep -o "Test unit written to .*" "$log" | tail -n 1 | sed 's/Test unit written to //' || true)
        printf 'fuzz: %-14s FAIL  %s; %s\n' "$t" "$why" "$stats"
        # the panic message (or sanitizer / libFuzzer error) and its summary
        awk '/panicked at/ {p=1; n=0} p && (/^stack backtrace:/ || /^note: / || n >= 8) {p=0}
             p {print "    " $0; n++} /^SUMMARY/ && !s {print "    " $0; s=1}' "$log" || true
        if [ -n "$crash" ]; then
            echo "    input: $crash"
            echo "    replay: $bin_dir/$t $crash"
        fi
        echo "    log: $log"
    fi
done

echo "fuzz: ${secs}s per target, toolchain $tc, sanitizer $sanitizer, build ${build_secs}s, total $((SECONDS - t_start))s"
echo "fuzz: $passed passed, $failed failed"
[ "$failed" = 0 ]
