#!/usr/bin/env bash
# One device call for the whole decode step: the CUDA tests (builder, graphs, adapters, lowerings, index
# kernels, V3.2 model), then bench_decode_step two ways (default backends with the HF rows and the goals; Triton decode)
# and bench_lowered_step (static vs autotuned decode + fusion passes, one process, interleaved replays). Raw files in $OUT/all.tgz; the short
# tables come last.   source .whl/env.sh && bash benchmarks/gpu_session.sh
set -u -o pipefail
O=${OUT:-out}
mkdir -p "$O/auto" "$O/tri" "$O/low"
export PYTHONUNBUFFERED=1
# TEST_PATHS: the CUDA tests to run first (default: graphs, adapters, builder, lowerings, index kernels)
read -r -a tests <<< "${TEST_PATHS:-tests/graphs tests/ops/adapters/test_adapters_cuda.py tests/test_builder.py \
tests/lowerings tests/ops/test_absorb.py tests/ops/triton/test_triton_index.py tests/model/test_sparse_cuda.py}"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m cuda "${tests[@]}" -q -n 8 -p no:cacheprovider --timeout 180 \
    -rfE > "$O/pytest.log" 2>&1
tail -n 6 "$O/pytest.log"
timeout 200 python3 benchmarks/bench_decode_step.py --out "$O/auto" --budget-s 150 --profile-replay > "$O/auto.log" 2>&1
timeout 110 python3 benchmarks/bench_decode_step.py --out "$O/tri" --only ours --backend triton --budget-s 80 \
    > "$O/tri.log" 2>&1
timeout 130 python3 benchmarks/bench_lowered_step.py --out "$O/low" --iters 30 > "$O/low.log" 2>&1
grep -E "^ours|replay only" "$O/tri/bench_decode_step.txt"
cat "$O/low/bench_lowered_step.txt"
head -n 22 "$O/auto/profile_replay.txt"
tail -n 32 "$O/auto/bench_decode_step.txt"
(cd "$O" && tar czf all.tgz --remove-files ./*.log auto tri low)
