# Sourced by a device call's script: gpu_env.sh, then `step NAME SECONDS CMD...` runs CMD under its own time limit,
# its output in $OUT/NAME.log, and appends one summary line (exit code, seconds, the log's last verdict line) to
# $OUT/summary.txt. PT: pytest as the steps call it.
source benches/live/gpu_env.sh
step() { local name=$1 lim=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  printf '%-24s rc=%-4s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
    "$(grep -E 'passed|failed|error|ok,|FAIL|mismatch' "$OUT/$name.log" | tail -1 | cut -c1-120)" >> "$OUT/summary.txt"; }
PT="python3 -m pytest -q -p no:cacheprovider"
