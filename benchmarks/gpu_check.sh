#!/usr/bin/env bash
# One device call: the CUDA tests of the Triton kernels, then bench_kernels.py. Everything lands in $OUT.
#   source .whl/env.sh && bash benchmarks/gpu_check.sh      (run from the repo root on the GPU machine)
# TEST_TIMEOUT / BENCH_TIMEOUT bound each stage (seconds) so the call ends inside its limit.
set -u -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-210}" python3 -m pytest -m cuda "${TEST_PATHS:-tests/ops}" -q -n "${TEST_WORKERS:-8}" \
    -p no:cacheprovider --timeout 150 --durations=12 -rfE 2>&1 | tee "$OUT/pytest.log" | tail -n 40
echo "pytest exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-220}" python3 benchmarks/bench_kernels.py --out "$OUT" --budget-s "${BENCH_BUDGET:-140}" \
    > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - t1 )) s"
cat "$OUT/bench_kernels.txt" 2>/dev/null || tail -n 80 "$OUT/bench.log"
