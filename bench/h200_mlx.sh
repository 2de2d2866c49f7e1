#!/usr/bin/env bash
# The MLX-on-GPU figures of bench/mlx_peer.py, as they were taken on the lent H200 (MLX's CUDA backend):
# the same MLX ops and mx.compile as on a Mac's Metal GPU, CUDA kernels underneath. The machine has no
# internet; the MLX wheels travel from here (../shared/tools/mlx-cuda-wheels.sh writes .mlxcuda/), and a
# call carries at most 64 MiB, so the ~90 MB mlx-cuda wheel comes in two halves over two calls:
#   bash bench/h200_mlx.sh stash  SHAPES   # carry .mlxcuda/p1 .mlxcuda/w: keep half 1; write checkpoints, convert
#   bash bench/h200_mlx.sh bench  SHAPES   # carry .mlxcuda/p2 (within 30 s): install MLX, run the benchmark
#   bash bench/h200_mlx.sh probe  SHAPES   # after bench: where the prefill's peak memory goes (mlx_memory_probe.py),
#                                          # fuselm with its prefill queued whole (FUSELM_INFLIGHT=0) and 2 layers ahead
#   bash bench/h200_mlx.sh kv8    SHAPES   # after bench: the 8-bit KV cache at 8k and 32k (bench/mlx_kv8.py)
#   bash bench/h200_mlx.sh wheels          # carry .mlxcuda/p1 .mlxcuda/w: keep half 1 only (no checkpoints)
#   bash bench/h200_mlx.sh pipeline        # carry .mlxcuda/p2: install MLX; bench/pipeline.py on the GPU (0.6b
#                                          # layers, q4, 2 and 3 ranks on the one GPU) and on the host's cores (tiny)
#   bash bench/h200_mlx.sh carry           # carry .c1/ .c2/ ...: keep their files (wheels, parts of a large file)
#   bash bench/h200_mlx.sh deps            # after carry: the wheels kept (transformers and what it needs at the
#                                          # version fuselm is tested with), installed without an index
#   bash bench/h200_mlx.sh specprep        # after deps, with every GGUF part carried (a call takes ~61 MiB with the
#                                          # ~7 MiB tree; four calls: mlx half 1 + wheels/mlx + part 9.4 MiB `wheels`;
#                                          # part 53.5 `carry`; wheels 32 + part 21.7 `deps`; mlx half 2 + part 9.2
#                                          # `spec`, which converts the graphs itself, the last part being with it:
#                                          # 166 s for conversion and a 3-round fuselm-only run, run 47):
#                                          # spec's fuselm graphs converted ahead, where a call can carry every part
#   bash bench/h200_mlx.sh spec            # after bench: SmolLM2-135M-Instruct from its GGUF file (carried in parts
#                                          # as .carry/smollm2.gguf.part*), bench/speculative.py (fuselm plain, ngram,
#                                          # the q4 drafting for the q8; mlx-lm plain and its draft model) and
#                                          # bench/api_vs_cli.py (API_RUNS=0: not), on MLX; bench/verify_step.py first
#                                          # (VERIFY_ARGS: its options, e.g. --advance; VERIFY_AB: A/B runs;
#                                          # SPEC_PEERS=0: fuselm plain and n-gram only; SPEC_TAG: a suffix
#                                          # for the result files, so that several runs in one call keep theirs)
# Any phase first keeps what the carried .c*/ folders hold (wheels, the GGUF parts) in the stash.
# SHAPES: bench/convert.py's (0.6b 4b, and the MoE olmoe-1b-7b olmoe-1b-7b-4l qwen3-30b-a3b-8l); QGROUPS=64 for one group.
# Later calls on the same warm machine run `bench` again without carrying anything.
# Results land in $OUT (the device tool brings them back): mlx-peer-gpu.json and the logs.
set -uo pipefail
phase=$1; shift
shapes=${*:-0.6b}
repo=$PWD
stash=/root/stash
work=/root/work
export PYTHONPATH=/root/fl HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
mkdir -p "$stash" "$work" "${OUT:-/tmp/out}"
# fuselm itself, installed outside the checkout, from this call's tree (a warm machine keeps the last call's)
rm -rf /root/fl && python3 -m pip install -q --no-deps --no-build-isolation --target /root/fl "$repo" || exit 1
for d in .c[0-9]*; do [ -d "$d" ] && cp -n "$d"/* "$stash/" 2>/dev/null; done
spec_models() {  # SmolLM2-135M-Instruct's fuselm graphs (q8, q4) from its GGUF file, carried in parts
    cat "$stash"/smollm2.gguf.part* > /root/smollm2.gguf || return 1
    sha256sum /root/smollm2.gguf
    cd /root  # the installed fuselm, not the checkout's top-level folders
    python3 - <<'PY'
import fuselm
fuselm.convert("/root/smollm2.gguf", "/root/smol/q8-exp", quant="q8", quiet=True, force=True)
fuselm.optimize("/root/smol/q8-exp", "/root/smol/q8", quiet=True, force=True)
fuselm.convert("/root/smollm2.gguf", "/root/smol/q4-exp", quant="q4", quiet=True, force=True)
fuselm.optimize("/root/smol/q4-exp", "/root/smol/q4", quiet=True, force=True)
from fuselm.exporter.gguf import checkpoint_for
print("hf", checkpoint_for("/root/smollm2.gguf"))
PY
}
case $phase in
carry)
    ls -la "$stash"
    ;;
specprep)
    spec_models
    ;;
deps)
    python3 -m pip install -q --no-index --find-links "$stash" "transformers==${TRANSFORMERS:-5.25.0}" gguf accelerate \
        2>&1 | tail -3
    python3 -c "import transformers, huggingface_hub; print('transformers', transformers.__version__, huggingface_hub.__version__)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ;;
wheels)
    cp .mlxcuda/p1/part00 "$stash/" && mkdir -p "$stash/mlxw" && cp .mlxcuda/w/*.whl "$stash/mlxw/"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ;;
stash)
    cp .mlxcuda/p1/part00 "$stash/" && mkdir -p "$stash/mlxw" && cp .mlxcuda/w/*.whl "$stash/mlxw/"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    # the CPU half of the preparation (checkpoints, fuselm convert + optimize): no GPU needed
    # (the MoE shapes too: olmoe-1b-7b, olmoe-1b-7b-4l, qwen3-30b-a3b-8l; each step timed with its peak RSS,
    # kept in $work/<shape>-prepare.json for the bench phase's rows)
    cd /root
    python3 "$repo/bench/mlx_peer.py" --stash --shapes $shapes --groups ${QGROUPS:-32 64} --work "$work" \
        2>&1 | tee "${OUT:-/tmp/out}/stash.log" || exit 1
    ;;
bench|probe|kv8|pipeline|spec)
    if ! python3 -c "import mlx.core" 2>/dev/null; then
        cat "$stash/part00" .mlxcuda/p2/part01 > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile /tmp/mlx_cuda_13-*.whl "$stash"/mlxw/*.whl || exit 1
    fi
    if [ "$phase" = spec ]; then
        cd /root
        [ -f /root/smol/q4/fuselm.json ] || spec_models || exit 1
        for m in ${VERIFY_MODELS:-q8 q4}; do  # what a verification step costs here against a one-token step
            python3 "$repo/bench/verify_step.py" /root/smol/$m --backend mlx --device gpu --rows 2 5 \
                --loop ${SPEC_LOOP:-0} ${VERIFY_ARGS:-} --out "$OUT/verify-step-h200-smollm2-$m.json" 2>&1 | tail -${SPEC_LOOP_LINES:-3}
        done
        # VERIFY_AB="ARGS,ARGS": the q8 graph once more per option set (e.g. --vector-rows 3), each step at a
        # new position, n-gram speculation traced as above (A/B)
        i=0; IFS=, read -ra sets <<< "${VERIFY_AB:-}"
        for ab in "${sets[@]}"; do
            i=$((i + 1)); echo "A/B $i: $ab"
            python3 "$repo/bench/verify_step.py" /root/smol/q8 --backend mlx --device gpu --rows 5 --advance $ab \
                --loop ${SPEC_LOOP:-0} --out "$OUT/verify-step-h200-smollm2-q8-ab$i${SPEC_TAG:-}.json" 2>&1 | tail -2
        done
        [ "${SPEC_BENCH:-1}" = 0 ] && exit 0  # (SPEC_LOOP=TOKENS SPEC_BENCH=0: the verification steps traced only)
        if [ "${SPEC_PEERS:-1}" = 0 ]; then  # fuselm's plain and n-gram decoding only (no mlx-lm, no draft model)
            python3 "$repo/bench/speculative.py" --model /root/smol/q8 --backend mlx --tokens ${SPEC_TOKENS:-128} ${SPEC_ARGS:-} \
                --runs ${SPEC_RUNS:-3} --out "$OUT/speculative-h200-smollm2${SPEC_TAG:-}.json" 2>&1 | tail -12
            exit 0
        fi
        hf=$(python3 -c "from fuselm.exporter.gguf import checkpoint_for; print(checkpoint_for('/root/smollm2.gguf'))")
        # mlx-lm 0.32 reads rope_theta only at the top of config.json (transformers 5 writes it in rope_parameters)
        python3 - "$hf" <<'PY'
import json, sys, shutil, pathlib
src = pathlib.Path(sys.argv[1]); dst = pathlib.Path("/root/smol/hf-for-mlx-lm")
shutil.copytree(src, dst, dirs_exist_ok=True)
c = json.loads((dst / "config.json").read_text()); c["rope_theta"] = c.get("rope_parameters", {}).get("rope_theta", 10000.0)
(dst / "config.json").write_text(json.dumps(c, indent=2))
PY
        python3 -m mlx_lm convert --hf-path /root/smol/hf-for-mlx-lm --mlx-path /root/smol/mlx-q8 -q --q-bits 8 \
            --q-group-size 32 >/dev/null 2>&1 || exit 1
        python3 -m mlx_lm convert --hf-path /root/smol/hf-for-mlx-lm --mlx-path /root/smol/mlx-q4 -q --q-bits 4 \
            --q-group-size 32 >/dev/null 2>&1 || exit 1
        python3 "$repo/bench/speculative.py" --model /root/smol/q8 --draft /root/smol/q4 --mlx-lm /root/smol/mlx-q8 \
            --mlx-lm-draft /root/smol/mlx-q4 --backend mlx --tokens ${SPEC_TOKENS:-128} --runs ${SPEC_RUNS:-3} \
            --out "$OUT/speculative-h200-smollm2${SPEC_TAG:-}.json" 2>&1 | tail -12
        [ "${API_RUNS:-5}" = 0 ] || python3 "$repo/bench/api_vs_cli.py" /root/smol/q4 --backend mlx --runs ${API_RUNS:-5} \
            --out "$OUT/api-vs-cli-h200-smollm2-q4.json" 2>&1 | tail -14
        exit 0
    fi
    if [ "$phase" = kv8 ]; then
        cd /root && python3 "$repo/bench/mlx_kv8.py" --shapes $shapes --contexts 8192 32768 --runs ${KV8_RUNS:-2} \
            --decode 32 --work "$work" --out "$OUT/mlx-kv8-gpu.json" 2>&1 | tail -30
        exit 0
    fi
    if [ "$phase" = pipeline ]; then
        cd /root
        # exit status of a plain MLX GPU process, and of `fuselm run` with the build thread off / on
        python3 -c "import mlx.core as mx; mx.set_default_device(mx.gpu); mx.eval(mx.ones(3) + 1)"; echo "plain MLX GPU process: exit $?"
        python3 -c "import fuselm; from fuselm.synth import make_checkpoint; c = make_checkpoint('/root/probe/hf', 'qwen3'); fuselm.convert(c, '/root/probe/exp', quant='q4', quiet=True); fuselm.optimize('/root/probe/exp', '/root/probe/opt', quiet=True)" >/dev/null 2>&1
        for t in 0 1; do
            FUSELM_BUILD_THREAD=$t python3 -m fuselm.cli run /root/probe/opt --prompt-ids 5,6 --max-tokens 8 --backend mlx \
                --device gpu >/dev/null 2>/tmp/probe.err
            echo "fuselm run --backend mlx --device gpu, FUSELM_BUILD_THREAD=$t: exit $? $(tail -c 300 /tmp/probe.err | tr '\n' ' ')"
        done
        python3 -c "import fuselm; from fuselm.runtime_metal.backends import mlx_backend as m; list(fuselm.stream_generate('/root/probe/opt', prompt_ids=[5, 6], max_tokens=8, backend='mlx', device='gpu')); m._build_thread()" 2>/tmp/probe.err
        echo "stream_generate with the build thread, at exit: exit $? $(tail -c 200 /tmp/probe.err | tr '\n' ' ')"
        [ "${PIPE_GPU:-1}" = 1 ] || exit 0
        python3 "$repo/bench/pipeline.py" --device gpu --shape 0.6b --ranks 2 3 --runs ${PIPE_RUNS:-3} --tokens 128 \
            --json "$OUT/pipeline-gpu-0.6b.json" 2>&1 | grep -v "Writing model" | tail -30
        [ "${PIPE_HOST:-1}" = 1 ] && python3 "$repo/bench/pipeline.py" --ranks 2 3 --runs ${PIPE_RUNS:-3} --tokens 256 \
            --json "$OUT/pipeline-host-tiny.json" 2>&1 | grep -v "Writing model" | tail -30
        exit 0
    fi
    if [ "$phase" = probe ]; then
        cd /root
        for s in $shapes; do
            for g in ${QGROUPS:-32}; do
                for d in 0 2; do
                    FUSELM_INFLIGHT=$d python3 "$repo/bench/mlx_memory_probe.py" "$work/qwen3-$s-q4-g$g" --dtype bf16 \
                        --lengths 512 2048 --decode 8 --mlx-lm "$work/qwen3-$s-mlxlm-g$g-bf16" \
                        --out "$OUT/mlx-memory-gpu-$s-g$g-inflight$d.json" 2>&1 | tail -40
                done
            done
        done
        exit 0
    fi
    python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device())"
    cd /root && python3 "$repo/bench/mlx_peer.py" --shapes $shapes --groups ${QGROUPS:-32 64} --work "$work" \
        --out "$OUT/mlx-peer-gpu.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/mlx-peer.log"
    ;;
esac
