#!/usr/bin/env bash
# One full verification pass on the GPU machine (binary built elsewhere with --features cuda).
# Writes logs and receipts under $OUT. Usage: scripts/gpu-verify.sh target/release/dramatis
# [all|contract|rest]. Since session 8 the whole pass can outlast one 600 s device call: run
# `contract` in one call and `rest` in the next (the contract prints each kernel group's start
# time on stderr, so a cut run shows how far it got).
set -uo pipefail
bin=${1:-target/release/dramatis}
phase=${2:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.csv" 2>&1
if [ "$phase" != rest ]; then
"$bin" kernel-contract > "$out/contract.log" 2>&1; echo "contract rc=$?" >> "$out/summary.txt"
grep '^SUMMARY' "$out/contract.log" >> "$out/summary.txt"
fi
if [ "$phase" = contract ]; then
  (cd "$out" && tar czf logs.tgz --remove-files ./*.log ./*.csv 2>/dev/null)
  cat "$out/summary.txt"
  exit 0
fi
"$bin" golden testdata/drama3-tiny --backend cuda > "$out/golden-cuda.log" 2>&1; echo "golden rc=$?" >> "$out/summary.txt"
grep '^GOLDEN' "$out/golden-cuda.log" >> "$out/summary.txt"
# decode attention without the head split (on by default since session 7)
DRAMATIS_CUDA_HEAD_SPLIT=0 "$bin" golden testdata/drama3-tiny --backend cuda > "$out/golden-cuda-nosplit.log" 2>&1; echo "golden no head split rc=$?" >> "$out/summary.txt"
grep '^GOLDEN' "$out/golden-cuda-nosplit.log" >> "$out/summary.txt"
# kept rounds with a graph, without, and host-drawn rounds give the same audio
for mode in kept nograph host; do
  case $mode in kept) e="DRAMATIS_CUDA_ROUNDS=device";; nograph) e="DRAMATIS_CUDA_GRAPH=0";; host) e="DRAMATIS_CUDA_ROUNDS=host";; esac
  env $e "$bin" say "Hello there. A second sentence." --backend cuda --frames 48 --seed 3 --out "$out/say-$mode.wav" > "$out/say-$mode.log" 2>&1
  echo "say $mode rc=$?" >> "$out/summary.txt"
done
# three hashes (one per run, so a crashed run shows), and how many distinct: must be 3 and 1
hashes=$(cat "$out"/say-*.log | grep -o 'pcm_sha256 [0-9a-f]*')
echo "say kept/nograph/host: $(echo "$hashes" | grep -c pcm_sha256) hash(es), $(echo "$hashes" | sort -u | grep -c pcm_sha256) distinct" >> "$out/summary.txt"
# guided (classifier-free guidance) rounds kept on the device = host-drawn guided rounds
for mode in kept host; do
  case $mode in kept) e="DRAMATIS_CUDA_ROUNDS=device";; host) e="DRAMATIS_CUDA_ROUNDS=host";; esac
  # guidance needs a reference (the kept say's output; it goes through the GPU encoder too)
  env $e "$bin" say "Hello there. A second sentence." --backend cuda --frames 48 --seed 5 --cfg-gamma 1.5 --ref "$out/say-kept.wav" --ref-text "Hello there. A second sentence." --out "$out/cfg-$mode.wav" > "$out/cfg-$mode.log" 2>&1
  echo "say cfg $mode rc=$?" >> "$out/summary.txt"
done
hashes=$(cat "$out"/cfg-*.log | grep -o 'pcm_sha256 [0-9a-f]*')
echo "say cfg kept/host: $(echo "$hashes" | grep -c pcm_sha256) hash(es), $(echo "$hashes" | sort -u | grep -c pcm_sha256) distinct" >> "$out/summary.txt"
for i in 1 2; do "$bin" say "Hello there. A second sentence." --backend cuda --frames 24 --seed 3 --out "$out/say$i.wav" >> "$out/say.log" 2>&1; done
echo "say twice on cuda: $(grep -o 'pcm_sha256 [0-9a-f]*' "$out/say.log" | sort -u | wc -l) distinct hash(es)" >> "$out/summary.txt"
timeout 150 "$bin" qualify-window --backend cuda --context 8192 --compare-cpu --out "$out/window-cuda-tiny-8192.json" > /dev/null 2>"$out/window8k.err"; echo "window 8192 rc=$?" >> "$out/summary.txt"
timeout 150 "$bin" qualify-window --backend cuda --context 65536 --out "$out/window-cuda-tiny-65536.json" > /dev/null 2>"$out/window64k.err"; echo "window 65536 rc=$?" >> "$out/summary.txt"
timeout 150 "$bin" qualify-window --backend cuda --context 262144 --out "$out/window-cuda-tiny-262144.json" > /dev/null 2>"$out/window256k.err"; echo "window 262144 rc=$?" >> "$out/summary.txt"
"$bin" fixture --geometry drama3 --seed 7 --out /tmp/d3 > "$out/fixture.log" 2>&1; echo "fixture rc=$?" >> "$out/summary.txt"
timeout 200 "$bin" bench --model /tmp/d3 --backend cuda --lanes 1,8 --frames 32 --runs 3 --prefill-rows 1024,8192 --out "$out/bench-cuda-drama3.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/summary.txt"
grep -E '^device (memory|state)' "$out/bench.log" >> "$out/summary.txt"   # the peak against the plan, the state used against the state reserved
# the device tool brings back at most 8 files: logs and audio travel as one archive
(cd "$out" && tar czf logs.tgz --remove-files ./*.log ./*.err ./*.csv ./*.wav 2>/dev/null)
cat "$out/summary.txt"
