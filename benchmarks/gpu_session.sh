#!/usr/bin/env bash
# One device call: the CUDA tests, then the benchmarks named in PHASES (comma-separated, in this order):
#   step     bench_decode_step two ways (default backends with the HF rows and the goals; Triton decode)
#   lowered  bench_lowered_step (static vs autotuned decode + fusion passes, one process, interleaved replays)
#   kernels  bench_kernels --quick (our kernels beside FlashMLA / FlashInfer / torch, one table)
#   decode   bench_kernels --decode --quick (the decode sections alone: H=128 B=128 with the Gluon variants, the
#            alternating SEESAW kernel, its FOLD_FIRST and its output / query copies without TMA among them, and its
#            PERSIST form; H=16 B=128 L=8192 with the swapped kernel's PERSIST form; H=128 B=1; H=128 B=66 L=512
#            with the cache resident in L2)
#   prefill  bench_kernels --prefill-persist (causal prefill: the warp-specialized Gluon kernel per program and
#            PERSIST, each with its output's TMA store and without, against FlashInfer)
#   fp8      bench_fp8_sparse --quick (fp8 vs bf16 decode, sparse decode, the V3.2 indexer)
#   fusions  bench_fusions (the decode step's opt-in fusions against the launches they replace)
#   backends bench_backends --only decode (BK_ONLY: other ops; BK_TIMEOUT: its seconds, default 240: decode alone fills
#            most of them on an H200) into a copy of the shipped timing file ("auto"
#            against the fastest, the adapters against the peers' direct calls, FlashMLA on the step schedule and
#            scheduling per call)
#   fusedstep the full-depth B=1 and B=8 rows (V2-Lite, 27 layers, regional + lowerings) without, then with the opt-in
#            fusions named in FUSIONS (a backend spec; default decode_absorb_out=gluon, the one not yet timed in
#            the step: skinny_norm_linear=triton lost there in run 218, "auto" takes the other two); one machine,
#            so the two rows compare
#   v4       bench_v4_decode (V4-Flash-dims slice: one sliding, CSA and HCA layer, bf16, ctx 8192) at B = 1 and 64, our
#            compiled step replayed as a CUDA graph, regional, with --profile-replay (kernels and their critical path);
#            V4_WEIGHTS=fp8|fp4 times V4-Flash's release formats instead of bf16 weights; V4_FLAGS: more
#            bench_v4_decode flags (e.g. --backend reference)
#   fp4      bench_fp4_experts (V4-Flash's fp4 routed experts: mla::moe_experts_fp4 gluon / fused / grouped / auto
#            against bf16 torch._grouped_mm at 1, 8, 16, 24, 64, 128, 256, 512 tokens (where the Gluon kernels stop
#            winning: GLUON_MAX_TOKENS_FP4), with the fused kernels' launch sweep up to "auto"'s split
#            (FUSED_MAX_TOKENS_FP4), the grouped path's sorted tiles above, and its tiled kernels' other decode,
#            TILED_WORDS)
#   v4par    bench_v4_decode under torchrun on every GPU of the machine (a multi-GPU kind): the V4-Flash slice
#            (V4_WEIGHTS, default fp4) sharded with its heads split (--parallel tp) and as data-parallel attention
#            (--parallel dp), experts split whole either way, our compiled step replayed as a CUDA graph
#   ncu      Nsight Compute counters of our kernels in ncu_kernels.py's NCU_CASES (default fp4moe,moe256: the MoE
#            kernels behind V4's B=64 step and #28's B=256 step): duration, DRAM / SM / tensor-pipe %, top stalls
#   parallel the two-GPU CUDA tests (-k two_gpus: DP-attention serving, TP2 + EP2 over NCCL, V4 DP attention + EP),
#            then bench_parallel (TP, DP-attention + EP, TP + DCP at V3 dims) at the world sizes 1, 2, 4, 8 the
#            machine holds; needs a multi-GPU kind (with TEST_PATHS=none SM90=0 the call has its whole time for them)
# Default PHASES=lowered,kernels (the whole CUDA suite first needs ~400 s of the 600: with the default
# TEST_TIMEOUT=450 pass PHASES=none, or a smaller TEST_PATHS, to leave time for a benchmark). Raw files in
# $OUT/all.tgz; the short tables come last.   source .whl/env.sh && bash benchmarks/gpu_session.sh
set -u -o pipefail
O=${OUT:-out}
mkdir -p "$O/auto" "$O/tri" "$O/low" "$O/ker" "$O/dec" "$O/pre" "$O/fp8" "$O/fus" "$O/base" "$O/fused" "$O/bk" "$O/par" \
    "$O/v4" "$O/fp4" "$O/ncu" "$O/v4tp" "$O/v4dp"
FUSIONS=${FUSIONS:-decode_absorb_out=gluon}
export PYTHONUNBUFFERED=1
PHASES=",${PHASES:-lowered,kernels},"
# TEST_PATHS: the CUDA tests to run first (default: all of them; "none": no CUDA tests); TEST_K: their -k
# expression (spaces allowed, e.g. "seesaw or persist"). -v: one line per finished test, so a run cut by its
# timeout still names its failures (grep FAILED pytest.log)
read -r -a tests <<< "${TEST_PATHS:-tests}"
[[ -n ${TEST_K:-} ]] && tests+=(-k "$TEST_K")
if [[ ${TEST_PATHS:-tests} == none ]]; then
    echo "no CUDA tests (TEST_PATHS=none)" > "$O/pytest.log"
else
    timeout "${TEST_TIMEOUT:-450}" python3 -m pytest -m cuda "${tests[@]}" -v -n 8 -p no:cacheprovider --timeout 180 \
        -rfE > "$O/pytest.log" 2>&1
fi
tail -n 6 "$O/pytest.log"
# the sm_90 compile checks (shared memory formulas, no spills): Triton's compiler, no GPU, no interpreter. CI
# runs them too (tests/ops/triton/test_sm90_compile_subprocess.py); CI also runs every test that is neither
# cuda nor sm90_compile, the Triton kernels in Triton's interpreter. SM90=0 skips them.
if [[ ${SM90:-1} == 0 ]]; then
    echo "sm_90 compile checks skipped (SM90=0)" > "$O/sm90_compile.log"
else
    TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m sm90_compile -rs tests \
        > "$O/sm90_compile.log" 2>&1
fi
tail -n 1 "$O/sm90_compile.log"
if [[ $PHASES == *,step,* ]]; then
    timeout 200 python3 benchmarks/bench_decode_step.py --out "$O/auto" --budget-s 150 --profile-replay > "$O/auto.log" 2>&1
    timeout 110 python3 benchmarks/bench_decode_step.py --out "$O/tri" --only ours --backend triton --budget-s 80 \
        > "$O/tri.log" 2>&1
fi
[[ $PHASES == *,lowered,* ]] && timeout 130 python3 benchmarks/bench_lowered_step.py --out "$O/low" --iters 30 > "$O/low.log" 2>&1
[[ $PHASES == *,kernels,* ]] && timeout 180 python3 benchmarks/bench_kernels.py --out "$O/ker" --quick --budget-s 150 \
    > "$O/ker.log" 2>&1
[[ $PHASES == *,decode,* ]] && timeout 200 python3 benchmarks/bench_kernels.py --out "$O/dec" --decode --quick \
    --budget-s 170 > "$O/dec.log" 2>&1
[[ $PHASES == *,prefill,* ]] && timeout 200 python3 benchmarks/bench_kernels.py --out "$O/pre" --prefill-persist \
    --budget-s 170 > "$O/pre.log" 2>&1
[[ $PHASES == *,fp8,* ]] && timeout 90 python3 benchmarks/bench_fp8_sparse.py --out "$O/fp8" --quick > "$O/fp8.log" 2>&1
[[ $PHASES == *,fusions,* ]] && timeout 150 python3 benchmarks/bench_fusions.py --out "$O/fus" > "$O/fus.log" 2>&1
if [[ $PHASES == *,backends,* ]]; then
    cp ops/backend_timings/h200.json "$O/bk/h200.json"
    timeout "${BK_TIMEOUT:-240}" python3 benchmarks/bench_backends.py --only "${BK_ONLY:-decode}" --out "$O/bk/h200.json" > "$O/bk.log" 2>&1
fi
if [[ $PHASES == *,fusedstep,* ]]; then
    step=(benchmarks/bench_decode_step.py --layers 27 --only ours --regional-compile --lowerings --warm-cache
          --batches 1,8 --budget-s 110)
    timeout 130 python3 "${step[@]}" --out "$O/base" > "$O/base.log" 2>&1
    timeout 130 python3 "${step[@]}" --out "$O/fused" --backend "$FUSIONS" > "$O/fused.log" 2>&1
fi
[[ $PHASES == *,v4,* ]] && timeout 200 python3 benchmarks/bench_v4_decode.py --out "$O/v4" --regional-compile \
    --impls "ours graph" --batches 1,64 --ctx 8192 --profile-replay --budget-s 170 --weights "${V4_WEIGHTS:-float}" \
    ${V4_FLAGS:-} > "$O/v4.log" 2>&1
[[ $PHASES == *,fp4,* ]] && timeout 300 python3 benchmarks/bench_fp4_experts.py --out "$O/fp4" --tokens 1,8,16,24,64,128,256,512 \
    --linears 0 --sweep > "$O/fp4.log" 2>&1
if [[ $PHASES == *,v4par,* ]]; then
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    for mode in tp dp; do
        timeout 240 python3 -m torch.distributed.run --nproc-per-node "$n" benchmarks/bench_v4_decode.py \
            --out "$O/v4$mode" --parallel "$mode" --regional-compile --impls "ours graph" --batches 1,64,256 \
            --ctx 8192 --budget-s 200 --weights "${V4_WEIGHTS:-fp4}" > "$O/v4$mode.log" 2>&1
    done
fi
if [[ $PHASES == *,ncu,* ]]; then
    timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --profile-from-start off \
        -k regex:"$(python3 benchmarks/ncu_kernels.py --print-regex)" --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --csv --page raw \
        python3 benchmarks/ncu_kernels.py --cases "${NCU_CASES:-fp4moe,moe256}" > "$O/ncu/ncu.csv" 2> "$O/ncu.log"
fi
if [[ $PHASES == *,parallel,* ]]; then
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    sizes=$(python3 -c "print(','.join(str(n) for n in (1, 2, 4, 8) if n <= max($gpus, 1)))")
    timeout 170 python3 -m pytest -m cuda -v -p no:cacheprovider --timeout 160 -rfE tests/test_dp_serving.py \
        tests/test_parallel_cuda.py tests/test_parallel_v4.py -k two_gpus > "$O/par_tests.log" 2>&1
    timeout 400 python3 benchmarks/bench_parallel.py --out "$O/par" --tp "$sizes" --modes tp,dp_ep,tp_dcp \
        --batches 1,64,256 --ctx 4096 --iters 10 --warmup 2 --budget-s 330 > "$O/par.log" 2>&1
fi
if [[ $PHASES == *,step,* ]]; then
    grep -E "^ours|replay only" "$O/tri/bench_decode_step.txt"
    head -n 22 "$O/auto/profile_replay.txt"
    tail -n 32 "$O/auto/bench_decode_step.txt"
fi
[[ $PHASES == *,lowered,* ]] && tail -n 6 "$O/low/bench_lowered_step.txt"
[[ $PHASES == *,kernels,* ]] && grep -E "^decode|^prefill|ours\)|FlashMLA |FlashInfer " "$O/ker/bench_kernels.txt"
[[ $PHASES == *,decode,* ]] && grep -E "^decode|ours\)|FlashMLA |FlashInfer |read floor" "$O/dec/bench_kernels.txt"
[[ $PHASES == *,prefill,* ]] && grep -E "^prefill|ours\)|gluon|FlashInfer " "$O/pre/bench_kernels.txt"
[[ $PHASES == *,fp8,* ]] && grep -E "speedup|triton fp8|gluon fp8|FlashMLA fp8" "$O/fp8/bench_fp8_sparse.txt"
[[ $PHASES == *,fusions,* ]] && cat "$O/fus/bench_fusions.txt"
[[ $PHASES == *,backends,* ]] && grep -E "^  auto|auto within|^  flashmla|^  flashinfer|adapters within" "$O/bk.log"
if [[ $PHASES == *,fusedstep,* ]]; then
    echo "full depth B=1, 8 without the fusions:"; grep -E "^ours|replay only" "$O/base/bench_decode_step.txt"
    echo "with $FUSIONS:"; grep -E "^ours|replay only" "$O/fused/bench_decode_step.txt"
fi
if [[ $PHASES == *,v4,* ]]; then
    grep -E "^ours graph" "$O/v4/bench_v4_decode.txt"
    head -n 8 "$O/v4/critical_path_b1_c8192.txt"
    head -n 12 "$O/v4/critical_path_b64_c8192.txt"
fi
[[ $PHASES == *,fp4,* ]] && grep -E "moe_experts_fp4|TILED_WORDS|bf16" "$O/fp4/bench_fp4_experts.txt"
if [[ $PHASES == *,v4par,* ]]; then
    for mode in tp dp; do grep -E "^ours graph|V4 decode step" "$O/v4$mode/bench_v4_decode.txt"; done
fi
[[ $PHASES == *,ncu,* ]] && python3 benchmarks/ncu_kernels.py --summarize "$O/ncu/ncu.csv" && grep "^#" "$O/ncu.log"
if [[ $PHASES == *,parallel,* ]]; then
    echo "GPUs: $gpus; two-GPU tests: $(tail -n 1 "$O/par_tests.log")"
    tail -n 30 "$O/par/bench_parallel.txt"
fi
# the summary: which test markers ran here (CI runs the rest: not cuda, the Triton tests interpreted)
echo "tests run here: -m cuda: $(tail -n 1 "$O/pytest.log")"
echo "tests run here: -m sm90_compile (TRITON_INTERPRET=0): $(tail -n 1 "$O/sm90_compile.log")"
(cd "$O" && tar czf all.tgz --remove-files ./*.log auto tri low ker fp8 fus base fused par v4 fp4 ncu v4tp v4dp)
