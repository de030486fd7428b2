#!/usr/bin/env bash
# Everything GPU-specific, built, checked and timed in one run (< 8 minutes on one H200); a table last.
#   bash tools/device_check.sh            (repository root or anywhere; logs under $OUT or /tmp)
# Uses the machine's own jax/flax/optax (nothing is installed): the repository goes on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
logs=${OUT:-/tmp/device_check}
mkdir -p "$logs"
rows=()

check() {  # check NAME TIMEOUT_S COMMAND...: run one check, log it, remember pass/FAIL and seconds
  local name=$1 limit=$2; shift 2
  local start=$SECONDS status=pass
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1 || status=FAIL
  rows+=("$(printf '%-22s %-5s %5ss  %s' "$name" "$status" "$((SECONDS - start))" "$(tail -n 1 "$logs/$name.log")")")
}

check environment 60 python3 -c "import jax, flax, optax; print(jax.__version__, jax.devices())"
check gpu-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/
check dispatch-timings 180 python3 tools/gpu_timings.py --json "$logs/dispatch_timings.json"

echo
printf '%-22s %-5s %6s  %s\n' check status time "last line of log ($logs)"
printf '%s\n' "${rows[@]}"
