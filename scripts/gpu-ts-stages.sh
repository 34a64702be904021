#!/usr/bin/env bash
# The device call for branch gemv-ts-stages (prepared in session 26, when no device came):
# the new gemv_ts (three step buffers, the default) checked (contract case, goldens, say's
# hash), gemvbench at 32 rows and 32 lanes against two buffers (DRAMATIS_CUDA_TS_STAGES=2),
# then 100-row first audio and the 1 / 8 / 32-lane receipts with the defaults. Every step is
# bounded by the time left (LIMIT seconds). Writes summary.txt, receipts and logs.tgz to $OUT.
set -u
T0=$SECONDS; LIMIT=${LIMIT:-480}
left() { echo $((LIMIT - (SECONDS - T0))); }
out=${OUT:-/tmp/out}; mkdir -p "$out"; S="$out/summary.txt"; L=$(mktemp -d)
run() { local s=$1 n=$2; shift 2; local l; l=$(left)
  if [ "$l" -lt 15 ]; then echo "$n: skipped (out of time)" >> "$S"; return 1; fi
  [ "$s" -gt "$l" ] && s=$l; local t=$SECONDS
  timeout "$s" "$@" > "$L/$n.log" 2>&1; local rc=$?
  echo "$n rc=$rc $((SECONDS - t))s" >> "$S"; return $rc; }
B=/tmp/bins; mkdir -p $B
# BIN_DIR (default .devbin) holds dramatis (--features cuda) and the backend-cuda example
# gemvbench, gzipped, as built here from this branch and carried to the device
for f in dramatis gemvbench; do gunzip -c "${BIN_DIR:-.devbin}/$f.gz" > $B/$f; chmod +x $B/$f; done
D=$B/dramatis
tag=2026-12-07-s26
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S" 2>&1
("$D" fixture --geometry drama3 --seed 7 --out /tmp/d3 > "$L/fixture.log" 2>&1; echo "fixture rc=$?" > "$L/fixture.rc") &
run 100 contract "$D" kernel-contract --only gemv_ts
grep '^SUMMARY' "$L/contract.log" >> "$S"
grep -iE "FAIL|missed" "$L/contract.log" | head -8 | cut -c1-300 >> "$S"
run 60 golden "$D" golden testdata/drama3-tiny --backend cuda
grep '^GOLDEN' "$L/golden.log" | tail -1 >> "$S"
run 40 say "$D" say "Hello there. A second sentence." --backend cuda --frames 48 --seed 3 --out "$L/say.wav"
echo "say tiny $(grep -o 'pcm_sha256 [0-9a-f]*' "$L/say.log")" >> "$S"
run 45 gb3 "$B/gemvbench" --rows 32
DRAMATIS_CUDA_TS_STAGES=2 run 45 gb2 "$B/gemvbench" --rows 32
paste -d'#' <(grep -E "^\| [a-zA-Z]" "$L/gb3.log") <(grep -E "^\| [a-zA-Z]" "$L/gb2.log") | cut -c1-300 >> "$S"
while [ ! -f "$L/fixture.rc" ] && [ "$(left)" -gt 30 ]; do sleep 2; done
cat "$L/fixture.rc" >> "$S" 2>/dev/null
summ() { python3 - "$1" "$2" >> "$S" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    c = r.get("codec", {})
    print(f"{sys.argv[2]} lanes {r['lanes']}: decode {r['decode_frames_per_s_median']:.1f}, in all "
          f"{r['aggregate_frames_per_s_median']:.1f}, kept round {r['rounds'].get('kept_round_ms_mean') or 0:.3f} ms, "
          f"first audio {r['time_to_first_audio_s_median']:.3f} s, codec busy {c.get('busy_fraction_of_runs') or 0:.2f}, "
          f"prompt_rows {d['settings'].get('prompt_rows')}")
if sys.argv[2] == "final":
    print("device_memory", json.dumps(d.get("device_memory"))[:500])
    print("prefill", json.dumps(d.get("prefill"))[:500])
PY
}
DRAMATIS_CUDA_TS_STAGES=2 run 70 l32-ts2 "$D" bench --model /tmp/d3 --backend cuda --lanes 32 --frames 64 --runs 2 --out "$L/l32-ts2.json" && summ "$L/l32-ts2.json" ts2
run 70 l32-ts3 "$D" bench --model /tmp/d3 --backend cuda --lanes 32 --frames 64 --runs 2 --out "$L/l32-ts3.json" && summ "$L/l32-ts3.json" ts3
for c in cached uncached; do
  extra=""; [ $c = uncached ] && extra="--prompt-cache-gib 0"
  run 45 ttfa-$c "$D" bench --model /tmp/d3 --backend cuda --lanes 1 --frames 8 --runs 5 --text "Hello there." \
    --reference-frames 6 $extra --out "$out/cuda-drama3-ttfa100-$c-$tag.json" &&
    summ "$out/cuda-drama3-ttfa100-$c-$tag.json" ttfa100-$c
done
run 300 bench "$D" bench --model /tmp/d3 --backend cuda --lanes 1,8,32 --frames 64 --runs 3 \
  --prefill-rows 1024 --out "$out/cuda-drama3-final-$tag.json" && summ "$out/cuda-drama3-final-$tag.json" final
(cd "$L" && tar czf "$out/logs.tgz" . 2>/dev/null)
cat "$S"
