#!/usr/bin/env bash
# Everything GPU-specific on one H200, in one run under 8 minutes, a table last:
#   1. the GPU-marked tests (cuDNN attention equal to blockwise and the reference in outputs, max logits
#      and gradients; ep_ragged equal to dense);
#   2. the memory planner against the compiled step of 16 H200s under jax_mock_gpu_topology
#      (tools/plan_check.py: one GPU compiles, never runs, the program of two mocked hosts of 8);
#   3. `composer-jax bench --preset gpu`: every benchmark on the proxy MoE (configs/model/proxy-moe.yaml,
#      batch sized to fill the GPU) side by side against its references;
#   4. MaxText's DeepSeek model on the same config, where MaxText is installed.
# Uses the machine's own jax/flax/optax/pytest (nothing is installed; no network): the repository goes
# on PYTHONPATH.
#   bash tools/device_check.sh                              on the GPU machine
#   DEVICE_CHECK_PLATFORM=cpu bash tools/device_check.sh    dry run on CPU: every step runs, the GPU
#                                                           tests are collected and skipped, the bench
#                                                           runs its quick CPU preset
# Environment: PYTHON (default python3), OUT (logs and bench.json; default /tmp/device_check),
# DEVICE_CHECK_BUDGET_S (all checks, default 470) and DEVICE_CHECK_BENCH_S (the bench, default 330): raise
# them for a dry run on a slow or busy CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
case ${DEVICE_CHECK_PLATFORM:-cuda} in
  cuda | gpu)
    platform=cuda bench_args=(--preset gpu)
    # 16 H200s (2 mocked hosts of 8) compiled on this one: the planner's estimate at scale
    plan_args=(--mock-gpu-topology 1x2x8 proxy-moe train.seq_len=4096 train.batch_size=16) ;;
  cpu)
    platform=cpu bench_args=(--preset cpu --quick)
    plan_args=(--cpu-devices 8 pretrain-tiny model.mtp.num_layers=0 model.num_layers=3 train.batch_size=16
               model.rope.factor=32 model.rope.max_position_embeddings=512 train.seq_len=256) ;;
  *) echo "device_check: DEVICE_CHECK_PLATFORM=$DEVICE_CHECK_PLATFORM: expected cuda or cpu" >&2; exit 2 ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=$platform
python=${PYTHON:-python3}
logs=${OUT:-/tmp/device_check}
mkdir -p "$logs"
deadline=$((SECONDS + ${DEVICE_CHECK_BUDGET_S:-470}))   # every check together stays under 8 minutes
rows=()
failed=0

row() {  # row NAME STATUS SECONDS TEXT
  rows+=("$(printf '%-16s %-5s %5ss  %s' "$1" "$2" "$3" "$4")")
}

check() {  # check NAME LIMIT_S COMMAND...: run one check (cut at the overall deadline), log it, keep a row
  local name=$1 limit=$2 start=$SECONDS status=pass
  shift 2
  local left=$((deadline - SECONDS))
  if ((left < 10)); then
    row "$name" skip 0 "no time left of the 8 minutes"
    return
  fi
  timeout $((limit < left ? limit : left)) "$@" >"$logs/$name.log" 2>&1 || status=FAIL
  [[ $status == FAIL ]] && failed=1
  row "$name" "$status" "$((SECONDS - start))" "$(grep -v '^\s*$' "$logs/$name.log" | tail -n 1)"
}

check environment 60 "$python" -c "import jax, flax, optax; print('python', __import__('sys').version.split()[0], \
'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.default_backend(), \
jax.devices()[0].device_kind)"

mapfile -t gpu_test_files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
check gpu-tests 100 "$python" -m pytest -q -rs -m gpu -p no:cacheprovider "${gpu_test_files[@]}"

if [[ -f composer_jax/plan/__init__.py ]]; then
  check planner 90 "$python" tools/plan_check.py "${plan_args[@]}"
else
  row planner skip 0 "memory planner not in this checkout (composer_jax/plan)"
fi

check bench "${DEVICE_CHECK_BENCH_S:-330}" "$python" -m composer_jax.cli bench --json "$logs/bench.json" "${bench_args[@]}"

if maxtext=$("$python" -c "import MaxText, importlib.metadata as m; print(m.version('maxtext'))" 2>/dev/null); then
  row maxtext skip 0 "MaxText $maxtext installed; a side-by-side run on proxy-moe is not wired in"
else
  row maxtext skip 0 "MaxText: not installed"
fi

echo
if [[ -f $logs/bench.json ]]; then   # also what a bench cut short measured (saved after each section)
  "$python" -c "import json, sys; from composer_jax.bench.suite import table; \
print(table(json.load(open(sys.argv[1]))))" "$logs/bench.json"
  echo
fi
printf '%-16s %-5s %6s  %s\n' check status time "last line of log ($logs)"
printf '%s\n' "${rows[@]}"
exit $failed
