#!/usr/bin/env bash
# One device call for the whole decode step: the CUDA tests of the builder, graphs and adapters, then
# bench_decode_step three ways (default backends with the HF rows and the goals; Triton decode; the
# Inductor lowerings with the autotuned decode and the fusion pass). Raw files in $OUT/all.tgz; the short
# tables come last.   source .whl/env.sh && bash benchmarks/gpu_session.sh
set -u -o pipefail
O=${OUT:-out}
mkdir -p "$O/auto" "$O/tri" "$O/low"
export PYTHONUNBUFFERED=1
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m cuda tests/graphs tests/ops/adapters/test_adapters_cuda.py \
    tests/test_builder.py -q -n 8 -p no:cacheprovider --timeout 180 -rfE > "$O/pytest.log" 2>&1
tail -n 6 "$O/pytest.log"
timeout 200 python3 benchmarks/bench_decode_step.py --out "$O/auto" --budget-s 150 --profile-replay > "$O/auto.log" 2>&1
timeout 110 python3 benchmarks/bench_decode_step.py --out "$O/tri" --only ours --backend triton --budget-s 80 \
    > "$O/tri.log" 2>&1
timeout 120 python3 benchmarks/bench_decode_step.py --out "$O/low" --only ours --backend decode=autotune --lowerings \
    --budget-s 90 > "$O/low.log" 2>&1
grep -E "^ours|replay only" "$O/tri/bench_decode_step.txt" "$O/low/bench_decode_step.txt"
head -n 22 "$O/auto/profile_replay.txt"
tail -n 32 "$O/auto/bench_decode_step.txt"
(cd "$O" && tar czf all.tgz --remove-files ./*.log auto tri low)
