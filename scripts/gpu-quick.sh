#!/usr/bin/env bash
# One bounded device pass for a change to the kernels (fits one device call; the whole contract
# of scripts/gpu-verify.sh does not): the contract of the named kernel groups, the codec's GPU
# check and A/B (examples/codec_gpu), the goldens, `say`'s PCM hash, Drama 3 parity, a bench
# at 1, 8 and 32 lanes, and first audio of a 181- and a 100-row prompt with a reference. Every
# step is bounded by the time left (LIMIT seconds, default 540), so a slow step cuts the pass
# short instead of the device call; `summary.txt` says which steps ran.
#
# Usage: scripts/gpu-quick.sh BIN_DIR [CONTRACT_PATTERN]
#   BIN_DIR holds dramatis (--features cuda) and, optionally, codec_gpu and parity (the
#   examples of codec-cuda and backend-cuda), as built here and carried to the device.
#   CONTRACT_PATTERN defaults to gemv,linear_many,gdn.
#   AB="NAME=VALUE ..." (optional) A/Bs each switch (ab1, ab2, .. in the order given) against one
#   default run, right after the fixture is written: gemvbench
#   --rows AB_ROWS 256:2 (the engine's layout; if BIN_DIR holds it), 32 lanes, and the prefill of
#   1024 and 8192 rows (one run), each with the defaults and with the switch; parity then runs
#   both ways too, and the 100- and 181-row first audio from nothing with the switch.
#   SKIP="NAME ..." (optional) leaves out the steps of those names (as summary.txt names them).
#   AB_TWICE=1 (optional) runs the 32 lanes a second time each way, alternated.
#   AB_ROWS=LIST (optional) the A/B's gemvbench row counts (default 32); AB_PREFILL=0 leaves out
#   the A/B's prefill runs (a switch the prefill does not reach).
#   BIN_DIR's kernelinfo (optional) prints the registers, spills and shared memory of the kernels
#   whose names hold KERNELINFO (default gemv_t: gemv_tc2*, gemv_tt*, gemv_ts*, gemv_tw*), right
#   after the contract.
#   PROFILE=1 (optional) also profiles, after the A/B: gemvbench at 512 and 1024 rows (the
#   prompts' `gemv_tt`), and the backend ops' device time (`DRAMATIS_CUDA_PROFILE=gpu`, graphs
#   off) of 32 lanes' joined prefills and rounds (with the rounds apart: 10 frames less 2), and of
#   one lane with a 1024-row prefill.
# BENCH_PREFILL=LIST (optional) the bench step's prefill rows (default 1024).
# Writes summary.txt and logs.tgz under $OUT (the device tool brings back few files).
set -u
bins=${1:?usage: scripts/gpu-quick.sh BIN_DIR [CONTRACT_PATTERN]}
pattern=${2:-gemv,linear_many,gdn}
T0=$SECONDS
LIMIT=${LIMIT:-540}
left() { echo $((LIMIT - (SECONDS - T0))); }
out=${OUT:-/tmp/out}
mkdir -p "$out"
S="$out/summary.txt"
L=$(mktemp -d)
# run SECONDS NAME CMD...: CMD under a timeout no longer than the time left; its output to NAME.log
run() {
  local s=$1 n=$2
  shift 2
  local l
  l=$(left)
  case " ${SKIP:-} " in
  *" $n "*)
    echo "$n: skipped (SKIP)" >> "$S"
    return 1
    ;;
  esac
  if [ "$l" -lt 15 ]; then
    echo "$n: skipped (out of time)" >> "$S"
    return 1
  fi
  [ "$s" -gt "$l" ] && s=$l
  local t=$SECONDS
  timeout "$s" "$@" > "$L/$n.log" 2>&1
  local rc=$?
  echo "$n rc=$rc $((SECONDS - t))s" >> "$S"
  return $rc
}
D="$bins/dramatis"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S" 2>&1
# the synthetic Drama 3 checkpoint, written beside the first steps
("$D" fixture --geometry drama3 --seed 7 --out /tmp/d3 > "$L/fixture.log" 2>&1
 echo "fixture rc=$?" > "$L/fixture.rc") &
run 200 contract "$D" kernel-contract --only "$pattern"
grep '^SUMMARY' "$L/contract.log" >> "$S"
if [ -x "$bins/kernelinfo" ]; then
  run 60 kernelinfo "$bins/kernelinfo" "${KERNELINFO:-gemv_t}" &&
    grep -E "^\| [a-z]" "$L/kernelinfo.log" | cut -c1-200 >> "$S"
fi
if [ -x "$bins/codec_gpu" ]; then
  run 150 codec_gpu "$bins/codec_gpu" testdata/drama3-tiny "$L/cuda-codec.json"
  grep -E "PASS gemm|FAIL|A/B|frames/s|ALL PASS" "$L/codec_gpu.log" | cut -c1-400 >> "$S"
fi
run 90 golden "$D" golden testdata/drama3-tiny --backend cuda
grep '^GOLDEN' "$L/golden.log" | tail -1 >> "$S"
run 60 say "$D" say "Hello there. A second sentence." --backend cuda --frames 48 --seed 3 --out "$L/say.wav"
grep -o 'pcm_sha256 [0-9a-f]*' "$L/say.log" >> "$S"
while [ ! -f "$L/fixture.rc" ] && [ "$(left)" -gt 30 ]; do sleep 2; done
cat "$L/fixture.rc" >> "$S" 2>/dev/null
if ! grep -qx 'fixture rc=0' "$L/fixture.rc" 2>/dev/null; then
  # every step below reads /tmp/d3
  echo "the Drama 3 fixture is missing or failed: parity, bench and first audio skipped" >> "$S"
  (cd "$L" && tar czf "$out/logs.tgz" . 2>/dev/null)
  cat "$S"
  exit 1
fi
lanes32() { # lanes32 NAME [ENV]: 32 lanes, 2 runs, the kept round
  local n=$1
  shift
  if run 75 "$n" env "$@" "$D" bench --model /tmp/d3 --backend cuda --lanes 32 --frames 64 --runs 2 \
    --out "$L/$n.json"; then
    python3 - "$L/$n.json" "$n" >> "$S" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
print(f"{sys.argv[2]}: kept round {r['rounds'].get('kept_round_ms_mean') or 0:.3f} ms, decode "
      f"{r['decode_frames_per_s_median']:.1f}, in all {r['aggregate_frames_per_s_median']:.1f}")
PY
  fi
}
# the switches of AB (space-separated NAME=VALUE), each A/B'd against one default run: names
# ab1, ab2, .. in the order given
read -r -a abs <<< "${AB:-}"
if [ "${#abs[@]}" -gt 0 ]; then
  if [ -x "$bins/gemvbench" ]; then
    run 45 gemvbench_default "$bins/gemvbench" --rows "${AB_ROWS:-32}" 256:2
    for i in "${!abs[@]}"; do
      a=ab$((i + 1))
      run 45 "gemvbench_$a" env "${abs[$i]}" "$bins/gemvbench" --rows "${AB_ROWS:-32}" 256:2
      echo "gemvbench: default # ${abs[$i]}" >> "$S"
      paste -d'#' <(grep -E "^\| [a-zA-Z]" "$L/gemvbench_default.log") \
        <(grep -E "^\| [a-zA-Z]" "$L/gemvbench_$a.log") | cut -c1-300 >> "$S"
    done
  fi
  for pass in 1 2; do
    [ "$pass" = 2 ] && [ "${AB_TWICE:-0}" != 1 ] && break
    sfx=$([ "$pass" = 2 ] && echo 2)
    lanes32 "lanes32_default$sfx"
    for i in "${!abs[@]}"; do
      echo "(ab$((i + 1)) = ${abs[$i]})" >> "$S"
      lanes32 "lanes32_ab$((i + 1))$sfx" "${abs[$i]}"
    done
  done
  for w in default "${!abs[@]}"; do
    [ "${AB_PREFILL:-1}" = 0 ] && break
    n=default
    sw=()
    if [ "$w" != default ]; then
      n=ab$((w + 1))
      sw=("${abs[$w]}")
    fi
    run 90 "prefill_$n" env "${sw[@]}" "$D" bench --model /tmp/d3 --backend cuda --lanes 1 --frames 8 \
      --runs 1 --prefill-rows 1024,8192 --out "$L/prefill_$n.json" &&
      grep -E '^prefill' "$L/prefill_$n.log" | sed "s/^/$n ${sw[*]}: /" >> "$S"
  done
fi
if [ -n "${PROFILE:-}" ]; then
  if [ -x "$bins/gemvbench" ]; then
    run 60 gemvbench_512 "$bins/gemvbench" --rows 512,1024 256:2 &&
      grep -E "^\| [a-zA-Z]" "$L/gemvbench_512.log" | cut -c1-200 >> "$S"
  fi
  # prof NAME ARGS...: the bench with graphs off and the ops' device time; the top 12 ops
  prof() {
    local n=$1
    shift
    run 90 "$n" env DRAMATIS_CUDA_GRAPH=0 DRAMATIS_CUDA_PROFILE=gpu "$D" bench --model /tmp/d3 \
      --backend cuda --runs 1 "$@" --out "$L/$n.json" &&
      grep -A14 "cuda profile" "$L/$n.log" | sed "s/^/$n: /" >> "$S"
  }
  prof profile_32 --lanes 32 --frames 2
  # the 32-lane rounds apart from the prompts: the ops' device time of 10 frames less that of 2,
  # over the 8 rounds between (issued rounds, graphs off)
  if prof profile_32r --lanes 32 --frames 10; then
    python3 - "$L/profile_32.log" "$L/profile_32r.log" >> "$S" <<'PY'
import re, sys
def ops(path):
    t = {}
    for line in open(path):
        m = re.match(r"^([a-z_0-9]+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s*$", line)
        if m:
            t[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    return t
a, b = ops(sys.argv[1]), ops(sys.argv[2])
rows = []
for op in set(a) | set(b):
    (ca, ma), (cb, mb) = a.get(op, (0, 0.0)), b.get(op, (0, 0.0))
    rows.append(((mb - ma) / 8, (cb - ca) / 8, op))
rows.sort(reverse=True)
print(f"32-lane round (10 - 2 frames, / 8): {sum(r[0] for r in rows):.2f} ms of ops' device time")
for ms, calls, op in rows[:16]:
    print(f"  round {op:20s} {ms:7.3f} ms  {calls:6.1f} calls")
PY
  fi
  prof profile_1 --lanes 1 --frames 16 --prefill-rows 1024
fi
if [ -x "$bins/parity" ]; then
  run 150 parity "$bins/parity" /tmp/d3 --rows 64 --frames 8 --out "$L/parity.json"
  grep -E "PASS|FAIL|JOINED" "$L/parity.log" | tail -4 >> "$S"
  for i in "${!abs[@]}"; do
    a=ab$((i + 1))
    run 150 "parity_$a" env "${abs[$i]}" "$bins/parity" /tmp/d3 --rows 64 --frames 8 \
      --out "$L/parity_$a.json"
    grep -E "PASS|FAIL|JOINED" "$L/parity_$a.log" | tail -4 | sed "s/^/$a ${abs[$i]}: /" >> "$S"
  done
fi
if run 200 bench "$D" bench --model /tmp/d3 --backend cuda --lanes 1,8,32 --frames 64 --runs 3 \
  --prefill-rows "${BENCH_PREFILL:-1024}" --out "$L/bench.json"; then
  python3 - "$L/bench.json" >> "$S" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    c = r.get("codec", {})
    print(f"lanes {r['lanes']}: decode {r['decode_frames_per_s_median']:.1f} frames/s, in all "
          f"{r['aggregate_frames_per_s_median']:.1f}, kept round "
          f"{r['rounds'].get('kept_round_ms_mean') or 0:.2f} ms, first audio "
          f"{r['time_to_first_audio_s_median']:.3f} s, codec after the last frame "
          f"{r['after_last_frame_s_median']:.3f} s, codec busy {c.get('busy_fraction_of_runs') or 0:.2f}")
PY
  grep -E '^device (memory|state|copy)|prefill' "$L/bench.log" | head -6 >> "$S"
  cp "$L/bench.json" "$out/" 2>/dev/null
fi
# first audio of prompts with a reference, prefix cached and prefilled from nothing: the bench
# text after 60 frames (181 rows) and "Hello there." after 6 frames (100 rows)
ttfa() { # ttfa NAME ARGS...: one lane, first audio median of 5 runs
  local n=$1
  shift
  local sw=()
  [ -n "${TTFA_ENV:-}" ] && sw=("$TTFA_ENV")
  if run 40 "$n" env "${sw[@]}" "$D" bench --model /tmp/d3 --backend cuda --lanes 1 --frames 8 --runs 5 "$@" \
    --out "$L/$n.json"; then
    python3 - "$L/$n.json" "$n" >> "$S" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
r = d["results"][0]
print(f"{sys.argv[2]}: {d['settings'].get('prompt_rows')} prompt rows, first audio "
      f"{r['time_to_first_audio_s_median']:.4f} s")
PY
  fi
}
ttfa ttfa181_cached --reference-frames 60
ttfa ttfa181_uncached --reference-frames 60 --prompt-cache-gib 0
ttfa ttfa100_cached --text "Hello there." --reference-frames 6
ttfa ttfa100_uncached --text "Hello there." --reference-frames 6 --prompt-cache-gib 0
for i in "${!abs[@]}"; do
  a=ab$((i + 1))
  TTFA_ENV=${abs[$i]} ttfa "ttfa100_uncached_$a" --text "Hello there." --reference-frames 6 \
    --prompt-cache-gib 0
  TTFA_ENV=${abs[$i]} ttfa "ttfa181_uncached_$a" --reference-frames 60 --prompt-cache-gib 0
done
(cd "$L" && tar czf "$out/logs.tgz" . 2>/dev/null)
cat "$S"
