#!/bin/bash
# The GPU checks the open issues still need, in one run on a lent device (see the device
# tool's README): `run` with command "bash benchmarks/gpu_checks.sh" and carry [".whl"].
#
# Before the run, on this machine, bring the pure-Python wheels the device lacks (torch 2.11,
# transformers 5.17 and diffusers are there; py3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl trl==1.16.0 datasets==5.2.0 tensordict==0.15.3 \
#     omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 math-verify==0.9.0 \
#     latex2sympy2_extended==1.11.0 bm25s==0.3.16 dill==0.4.1 multiprocess==0.70.19 \
#     importlib_metadata==9.1.0 pyvers==0.2.3
# (.whl is git-ignored through .git/info/exclude). Each step has its own timeout; together
# they fit in about 9 minutes on an H100/H200, most important first. Results go to $OUT.
# `bash benchmarks/gpu_checks.sh flow` runs issue 35's instead (about 7 minutes): lmrl
# train-flow on a random pipeline of SD3.5 Medium's shape, the marked test and the benchmark.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed (is .whl there?)"
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 HF_HOME=/tmp/hf PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
mark() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }

if [ "${1:-}" = flow ]; then
    mark "SD3.5-M-shaped train-flow test (issue 35)"
    timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu --timeout=290 \
        tests/flow/test_sd3.py -k sd35 > "$OUT/flow_gpu_test.log" 2>&1
    tail -8 "$OUT/flow_gpu_test.log"
    mark "flow_sd3 --train-flow: images/s, peak memory, Fast against full (issue 35)"
    timeout 270 python3 benchmarks/flow_sd3.py --train-flow --images 16 --repeat 1 \
        > "$OUT/flow_sd3_train_flow.log" 2>&1
    tail -20 "$OUT/flow_sd3_train_flow.log"
    mark done
    exit 0
fi

mark "gpu tests (issues 32, 33, 35)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout=140 \
    tests/trainer/test_memory_probe.py tests/trainer/test_gpu.py tests/rollout/test_static_decode.py \
    tests/flow -k "not sd35" > "$OUT/gpu_tests.log" 2>&1
tail -8 "$OUT/gpu_tests.log"

mark "precision_step (issue 32: fp32 against bf16 over fp32 masters, s/step and peak memory)"
timeout 120 python3 benchmarks/precision_step.py --device cuda --reps 2 \
    > "$OUT/precision_step.log" 2>&1
tail -8 "$OUT/precision_step.log"

mark "plan_check without gradient checkpointing too (issue 32)"
timeout 120 python3 benchmarks/plan_check.py --no-checkpointing-too \
    --out "$OUT/plan_check.json" > "$OUT/plan_check.log" 2>&1
tail -16 "$OUT/plan_check.log"

mark "gpu_step 0.5B, lmrl then TRL (issue 33)"
timeout 170 python3 benchmarks/gpu_step.py --shapes 0.5b --sides lmrl,trl --warmup 1 \
    --steps 2 --budget 160 --child-timeout 150 --out "$OUT/gpu_step.json" --work /tmp/gs \
    > "$OUT/gpu_step.log" 2>&1
tail -14 "$OUT/gpu_step.log"
mark done
