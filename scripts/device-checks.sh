#!/usr/bin/env bash
# The GPU and 16-core checks of issues 28 and 29, as one command for the
# lent device machine (see ../.library/device/README.md; nothing in CI runs
# this). Here, first:
#     ../shared/device/prepare.sh && scripts/device-checks.sh --prepare
# then on the device, with carry [".device"]:
#     . .device/setup.sh; scripts/device-checks.sh [STAGE ...]
# Every stage writes its log and JSON to $OUT (or out/device); a stage that
# fails or runs past its limit does not stop the next.
set -uo pipefail
# The lease returns at most 8 files from $OUT: every stage writes under $out and
# the whole of it is packed into $OUT/device.tgz after each stage, so a call
# cut at its limit still brings back what finished.
if [ -n "${OUT:-}" ]; then out=/tmp/device-out; else out=out/device; fi
mkdir -p "$out"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/device.tgz" -C "$out" . ; }
if [ "${1:-}" = "--prepare" ]; then
  # the device machine may have no /usr/share/doc: carry 4 MB of this one's
  python3 - <<'PYEOF'
import importlib.util, pathlib
spec = importlib.util.spec_from_file_location("train_lm", "examples/train_lm.py")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
data = m.corpus(4.0)
pathlib.Path(".device/corpus.txt").write_bytes(bytes(data.to(dtype=__import__("torch").uint8).tolist()))
print(f"wrote .device/corpus.txt ({len(data)} bytes)")
PYEOF
  exit 0
fi
corpus=.device/corpus.txt
# what has not run on the device yet comes first (docs/network.md, "Not
# done yet"): the testbed with receive offload (GRO) at every rate, Gloo
# beside, and the keyed allreduce with 8 shards. A lease is 15 device-minutes
# in all, a cold start one or two of them, and a call should leave time to run
# it again: the default is about 4.5 minutes. The next call, if time is left:
# `gro-group gro-lanes` (results to a group the switch's data plane copies,
# with a keyed arm; send lanes with GRO). A stage whose limit no longer fits
# in FANIN_DEVICE_BUDGET_S (default 280) is skipped, not cut
stages=${*:-"gro auth-shards8"}
budget=${FANIN_DEVICE_BUDGET_S:-280}
run() {  # run NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ $((SECONDS + limit)) -gt "$budget" ]; then
    echo "== $name: skipped, ${limit}s would pass the ${budget}s budget (at ${SECONDS}s)"; return
  fi
  echo "== $name ($(date +%T), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.json" 2> "$out/$name.log"
  echo "== $name: exit $? after $((SECONDS - t0)) s"; tail -n 12 "$out/$name.log"; pack
}
nvidia-smi -L; nproc
for s in $stages; do
  case $s in
    tests) run cuda-tests 120 python3 -m pytest -q -p no:cacheprovider python/tests/test_torch_backend.py -k cuda -rs ;;
    allreduce) run torch-allreduce-cuda 80 fanin bench torch-allreduce --device cuda --workers 4 \
                 --sizes 16MB,64MB --dtypes float32,float16 --iters 3 --json --out "$out" ;;
    lm-steps) run lm-steps-cuda 140 fanin bench lm-steps --device cuda --workers 8 --rates 1000 --steps 30 \
                --layers 4 --d-model 256 --corpus "$corpus" --systems fanin,fanin-fp16,gloo,fanin-fsdp,gloo-fsdp \
                --json --out "$out" ;;
    lm-ddp) run lm-ddp-cuda 80 fanin bench lm-steps --device cuda --workers 8 --rates 1000 --steps 60 \
              --layers 4 --d-model 256 --corpus "$corpus" --systems fanin,gloo --json --out "$out/ddp" ;;
    lm-fsdp) run lm-fsdp-cuda 90 fanin bench lm-steps --device cuda --workers 8 --rates 1000 --steps 20 \
               --layers 4 --d-model 256 --corpus "$corpus" --systems fanin-fsdp,gloo-fsdp --json --out "$out/fsdp" ;;
    tta) run lm-tta-cuda 200 fanin bench time-to-accuracy --model lm --device cuda --workers 8 --rate-mbit 1000 \
           --steps 100 --layers 4 --d-model 256 --corpus "$corpus" --json --out "$out" ;;
    image) run image-steps-cuda 100 fanin bench image-steps --device cuda --workers 8 --rates 1000 --steps 8 \
             --batch 32 --image-size 224 --json --out "$out" ;;
    network) run network-16core 170 fanin bench network --workers 8 --rates 1000,2500,5000,10000 --size 16MB --reps 3 \
               --json --out "$out" ;;
    # receive offload on every testbed interface (docs/network.md, "Receive
    # offload"): the same defaults' run as `network`, every arm and the
    # capacity blast on links whose receivers coalesce, as real NICs' do
    gro) run network-gro-16core 170 fanin bench network --workers 8 --rates 1000,2500,5000,10000 --size 16MB \
           --reps 3 --gro --json --out "$out/gro" ;;
    # results as a switch returns them: one send by the daemon, copied to
    # every host link by the switch namespace's data plane (--results
    # group); a keyed arm beside, whose results are then sealed once
    gro-group) run network-gro-group 90 fanin bench network --workers 8 --rates 5000,10000 --size 16MB --reps 3 \
                 --gro --results group --auth --no-gloo --json --out "$out/gro-group" ;;
    gro-lanes) run network-gro-lanes 90 fanin bench network --workers 8 --rates 5000,10000 --size 16MB --reps 3 \
                 --gro --lanes-arm 2 --no-gloo --json --out "$out/gro-lanes" ;;
    network-rs) run network-rs-16core 60 fanin bench network --workers 8 --rates 1000 --size 16MB --reps 3 \
                  --collective reduce-scatter --json --out "$out/rs" ;;
    auth) for w in 4 8; do run auth-$w 45 fanin bench allreduce --auth --quick --iters 9 --workers $w --shards 4 --json; done ;;
    auth-default) for w in 4 8; do run auth-default-$w 45 fanin bench allreduce --auth --quick --iters 9 --workers $w --json; done ;;
    auth-shards8) for w in 4 8; do run auth-shards8-$w 45 fanin bench allreduce --auth --quick --iters 9 --workers $w --shards 8 --json; done ;;
    # 64 MB per worker: at 10 Gbit/s a 16 MB allreduce takes ~15 ms, where fixed costs show
    jumbo-64) run network-jumbo-64 150 fanin bench network --workers 8 --rates 5000,10000 --size 64MB --reps 3 \
                --mtu 9000 --auth --json --out "$out/jumbo-64" ;;
    jumbo-full-64) run network-jumbo-full-64 90 fanin bench network --workers 8 --rates 5000,10000 --size 64MB --reps 3 \
                     --mtu 9000 --block-grad-max 4096 --no-gloo --json --out "$out/jumbo-full-64" ;;
    # jumbo frames on every link (fanin learns the MTU at join), with a keyed arm
    jumbo) run network-jumbo 220 fanin bench network --workers 8 --rates 1000,2500,5000,10000 --size 16MB --reps 3 \
             --mtu 9000 --auth --json --out "$out/jumbo" ;;
    # the same with blocks that fill a 9000-byte frame (the switch caps 4096 to the MTU)
    jumbo-full) run network-jumbo-full 80 fanin bench network --workers 8 --rates 5000,10000 --size 16MB --reps 3 \
                  --mtu 9000 --block-grad-max 4096 --no-gloo --json --out "$out/jumbo-full" ;;
    # the rates that miss 0.9 of capacity with 1500-byte frames, with jumbo
    # frames and a keyed arm; and with 4 switch shards instead of the default 8
    jumbo-hi) run network-jumbo-hi 110 fanin bench network --workers 8 --rates 5000,10000 --size 16MB --reps 3 \
                --mtu 9000 --auth --json --out "$out/jumbo-hi" ;;
    shards4) run network-shards4 70 fanin bench network --workers 8 --rates 5000,10000 --size 16MB --reps 3 \
               --shards 4 --no-gloo --json --out "$out/shards4" ;;
    # a worker on several threads (docs/network.md, "A worker on several
    # threads"): the same job settings, each worker's datagrams sent from 2
    # or 3 sockets and threads (Session(lanes=N)), alternated in one run with
    # the 1-lane arm (5 Gbit/s moves by 20 % between runs; lanes_speedup)
    lanes) for l in 2 3; do
             run network-lanes-$l 90 fanin bench network --workers 8 --rates 5000,10000 --size 16MB \
               --reps 3 --lanes-arm $l --no-gloo --json --out "$out/lanes-$l"; done ;;
    # if 8 workers x 2 lanes + 8 shards oversubscribe the 16 cores: 4 shards, 2 lanes
    lanes-shards4) run network-lanes-shards4 90 fanin bench network --workers 8 --rates 5000,10000 --size 16MB \
                     --reps 3 --shards 4 --lanes-arm 2 --no-gloo --json --out "$out/lanes-shards4" ;;
    lanes-jumbo) run network-lanes-jumbo 90 fanin bench network --workers 8 --rates 5000,10000 --size 16MB \
                   --reps 3 --mtu 9000 --lanes-arm 2 --no-gloo --json --out "$out/lanes-jumbo" ;;
    # per-datagram cost on these cores: the switch (bench allreduce) and a raw forwarding thread
    cost) run switch-cost-8 60 fanin bench allreduce --quick --workers 8 --iters 7 --json
          if [ -x .device/bin/udp_forward_bench ]; then
            run udp-forward-4120 40 .device/bin/udp_forward_bench --secs 1 --reps 5 --size 4120
          fi ;;
    *) echo "unknown stage $s (tests, allreduce, lm-steps, lm-ddp, lm-fsdp, tta, image, network, gro, gro-group, gro-lanes, network-rs, auth," \
            "auth-default, auth-shards8, jumbo, jumbo-hi, jumbo-full, jumbo-64, jumbo-full-64, shards4, lanes, lanes-shards4, lanes-jumbo, cost)"; exit 2 ;;
  esac
done
