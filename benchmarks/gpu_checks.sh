#!/bin/bash
# The GPU checks the open issues still need, in one run on a lent device (see the device
# tool's README): `run` with command "bash benchmarks/gpu_checks.sh" and carry [".whl"].
#
# Before the run, on this machine, bring the pure-Python wheels the device lacks (torch 2.11
# and transformers 5.17 are there; py3.12; the flow check also needs diffusers==0.42.1):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl trl==1.16.0 datasets==5.2.0 tensordict==0.15.3 \
#     omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 math-verify==0.9.0 \
#     latex2sympy2_extended==1.11.0 bm25s==0.3.16 dill==0.4.1 multiprocess==0.70.19 \
#     importlib_metadata==9.1.0 pyvers==0.2.3 diffusers==0.42.1
# (.whl is git-ignored through .git/info/exclude). Each step has its own timeout, most
# important first; together at most 10 minutes. Results go to $OUT.
# `bash benchmarks/gpu_checks.sh flow [CAP]` runs issue 35's benchmark instead (86 s on an
# H200, 2026-11-27): lmrl train-flow on a random pipeline of SD3.5 Medium's shape, Fast against
# full; `... step15 [CAP]` the 1.5B shape of gpu_step (159 s on an H200, 2026-11-27; give it 250). CAP: its
# timeout in seconds.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed (is .whl there?)"
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 HF_HOME=/tmp/hf PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
mark() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }

CAP=${2:-270}  # seconds for the flow or step15 run
if [ "${1:-}" = flow ]; then
    mark "flow_sd3 --train-flow: images/s, peak memory, Fast against full (issue 35)"
    timeout "$CAP" python3 benchmarks/flow_sd3.py --train-flow --images 16 --repeat 1 \
        > "$OUT/flow_sd3_train_flow.log" 2>&1
    tail -20 "$OUT/flow_sd3_train_flow.log"
    mark done
    exit 0
fi
if [ "${1:-}" = step15 ]; then
    mark "gpu_step 1.5B, lmrl (graphs decode) then TRL (issue 33)"
    timeout "$CAP" python3 benchmarks/gpu_step.py --shapes 1.5b --sides lmrl,trl --warmup 1 \
        --steps 1 --budget $((CAP - 10)) --child-timeout $((CAP * 2 / 3)) \
        --out "$OUT/gpu_step_15.json" --work /tmp/gs --lmrl-args rollout.hf.decode=graphs \
        > "$OUT/gpu_step_15.log" 2>&1
    tail -16 "$OUT/gpu_step_15.log"
    mark done
    exit 0
fi

mark "static decode, packing, shared prompts, fused head and trainer gpu tests (issue 33)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --timeout=95 \
    tests/models/test_forward.py tests/rollout/test_static_decode.py tests/models/test_packing.py \
    tests/algos/test_logprob.py tests/trainer/test_gpu.py \
    tests/workers/test_gpu.py::test_no_micro_batch_of_an_update_synchronizes_on_cuda \
    > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"

# On an H200 (2026-11-27) lmrl's 1.5B update took 8.34 s with prompts shared under
# checkpointing (6.30 s without, older code), and both profiled gpu_step children ran out of time.
# gpu_update times the update alone, the variants alternating on the step's batch and on a copy
# with prompts of different lengths: is sharing under checkpointing faster on CUDA (then add
# "cuda" to CHECKPOINTED_SHARING_DEVICES, for both batches or ragged ones), and what does the
# recompute cost?
mark "gpu_update 1.5B: checkpointed shared / unshared, no checkpointing; profile (issue 33)"
# ckpt:shared:reads is ckpt:shared without the host's layout of the rows, each
# micro-batch reading its shape back from the device as before: what the layout gains on CUDA.
timeout 280 python3 benchmarks/gpu_update.py --shape 1.5b --rounds 2 --profile ckpt:shared \
    --work /tmp/gu --out "$OUT/gpu_update.json" > "$OUT/gpu_update.log" 2>&1
tail -12 "$OUT/gpu_update.log"
head -30 "$OUT/gpu_update_profile_ckpt_shared.txt" 2>/dev/null

# The decode steps' RMSNorm through F.rms_norm (lmrl.rollout.static.FUSED_NORM, off
# by default): turn it on where graphs-fusednorm beats graphs.
mark "gpu_decode 0.5B: graphs against graphs with fused RMSNorms (issue 33)"
timeout 120 python3 benchmarks/gpu_decode.py --modes graphs,graphs-fusednorm \
    --out "$OUT/gpu_decode.json" > "$OUT/gpu_decode.log" 2>&1
tail -8 "$OUT/gpu_decode.log"
mark done
# Then, with what these said applied, `bash benchmarks/gpu_checks.sh step15 250`: lmrl's 1.5B
# step against TRL's (TRL's side has needed more than 100 s of wall time).
