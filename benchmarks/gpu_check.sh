#!/usr/bin/env bash
# The GPU check in one call of the device machine (at most 8 minutes), most important first;
# after each step the results so far are packed into $OUT, so a call cut short still returns
# what it reached. The device (H100 or H200) is named in every result file.
#
#   0. kernels: the CUDA codecs' gpu tests against the reference (a fault would take the
#      measure step's process down: without a pass, the engine's steps use the reference);
#   1. measure: `cswap bench measure` on GPT-2 medium (s1024 b8) and ResNet-50 (b128), bf16:
#      this device's profile, the planner's mixes from it at 85%, 50% and checkpointing's
#      peak, then no offload, checkpointing, each budget, the default engine and every
#      tensor swapped through int8 (how the replay should charge encoding) measured
#      interleaved beside the predictions, each with the host's time beside the device's,
#      and one more step of each traced (the device's kernel and copy time: what it waited
#      for);
#   1b. finetune: `cswap bench finetune llama-3-8b --lora --seq 8192` (issue 29's setup, all 32
#      layers, peft's LoRA, one copy of the model): no offload, checkpointing, cswap at
#      checkpointing's peak and at 75% fewer saved activations, lossless, with the exponent
#      codec weighed (`--dense`) and through int8 (the goals `predictions-issue29-*`
#      predicted for an H100 PCIe; `cswap plan ... --device h200` estimates this device),
#      then the peers: transformers' offload and torch's selective checkpointing (matmuls
#      and attention saved);
#   2. measure-llama: the same for Llama-3-8B's layer shapes (4 layers, s4096 b1: LLM
#      fine-tuning, the planner's mixes and int8 against checkpointing; its profile too);
#   3. codec: zvc, rle, exponent (bfloat16, and a transformer's MLP outputs), int8 and fp8 at
#      16 and 64 MiB against a device-to-device copy (the lossy codecs' and the exponent
#      codec's speeds are what the planner weighs them on the link by);
#   4. selective: Llama-3-8B's layer shapes (4 layers, s4096 b1) recomputed below the layer
#      and whole, with and without first runs without autograd, against plain training: step
#      time (forward's host and end, backward), the allocator's peak, gradients bitwise
#      beside plain against plain, one step of each under torch.profiler (the time the GPU
#      ran kernels beside the step's) and three under cProfile (where the host's time goes:
#      `benchmarks/selective.py --profile`);
#   5. overhead: host time per saved tensor on CUDA (`cswap bench overhead --device cuda`);
#   6. exit-codes: the CUDA cases of tests/test_exit.py (exit status with and without close(),
#      the CUDA codecs; CI runs the CPU ones);
#   7. pytest-gpu: `pytest -m gpu -v` with what time is left, but tests/test_exit.py (step 6
#      ran it; each test named in the log as it ends, so a step cut short still says which
#      failed);
#   8. measure-more: BERT-large and VGG-16, measured like the others, if time remains;
#   9. finetune-qlora: the finetune step's setup with QLoRA's 4-bit base (bitsandbytes, from
#      .whl), if time remains (or ONLY=finetune-qlora in a second call).
#
# How to call it (from a session whose device `status` says a machine is lent):
#   once, here, in the repository root (the wheels the image lacks, and the codec library built
#   with this machine's nvcc 13.0, the device's too, so the device need not compile it):
#     echo /.whl/ >> .git/info/exclude; echo /.devcache/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl hyperopt==0.3.0 jsonargparse==4.53.0 docstring-parser==0.18.0 \
#       typeshed-client==2.14.0 peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 \
#       bitsandbytes==0.50.2
#     CSWAP_CACHE_DIR=$PWD/.devcache .venv/bin/python -m cswap_lightning build-ext
#   then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".devcache"],
#             timeout_s=500)
#   What comes back: summary.txt (each step's exit code and time, the measure table) and
#   check.tar.gz (every log and result file, the profiles). Commit the results under
#   benchmarks/results/ and the profiles under cswap_lightning/planning/evidence/.
#   This device's time (15 minutes a session, starts included) fits this call with its
#   default budget and a second, shorter one for some of the steps it did not reach (choose
#   them with ONLY=...).
#
# Reading an engine row of the measure tables (why is it slower than its replay?): its
# forward's device and host times (near each other: the host set the pace, or waited); the
# host's own waits in "what ran" (forward at the in-flight bound, backward for restores);
# the traced step's kernel and copy time (far below the step: the device sat idle); the
# allocator's cudaMalloc calls and retries (host stalls, device syncs); in the JSON, what the
# engine's step without hooks timed (`engine_plain_forward_s`, `..._backward_s`: its
# replay's windows are scaled to them; `..._host_forward_s`, a host forward near the device's
# means the host sets the pace) beside `engine_host_windows_s`, the host clock its replay runs
# on (its measured steps' time outside the hooks: near the plain host forward if the hooks'
# time is all they add) and the device's idle time before
# the first kernel (`enter_s`: the engine's own start of step). Replay changes follow from
# those, not from the step times alone.
#
# Environment: OUT (set by the device machine), BUDGET_S (seconds for the whole call, default
# 450), ONLY (space-separated step names to run instead of all), MODELS (the measure step's,
# default "gpt2-medium resnet50"), FT_SEQ (the finetune step's sequence, default 8192), TESTS
# (pytest node ids to run before the measure step, as the step "tests"; by default the code no
# GPU has run yet), DRY=1 (list each step with its limit and command, run nothing:
# `DRY=1 bash benchmarks/gpu_check.sh`).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-check-out}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)/check
SUMMARY=$WORK/summary.txt
DEADLINE=$((SECONDS + ${BUDGET_S:-450}))
RESERVE=10  # seconds kept for the last packing
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[[ -d .devcache ]] && export CSWAP_CACHE_DIR=$PWD/.devcache
mkdir -p "$OUT" "$WORK"

selected() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* ]]; }

# pack: the logs and result files so far into $OUT/check.tar.gz, the summary beside it.
pack() {
    [[ -n ${DRY:-} ]] && return 0
    tar czf "$OUT/check.tar.gz.tmp" -C "$(dirname "$WORK")" check &&
        mv "$OUT/check.tar.gz.tmp" "$OUT/check.tar.gz"
    cp "$SUMMARY" "$OUT/summary.txt"
}

# step NAME CAP COMMAND...: COMMAND with a time limit (CAP, or what is left if less), its
# output to $WORK/NAME.log; its exit code and time, and the end of its log if it failed, to
# the summary; then pack.
step() {
    local name=$1 cap=$2 began=$SECONDS limit rc verdict=ok
    selected "$name" || return 0
    shift 2
    limit=$((DEADLINE - SECONDS - RESERVE))
    ((cap < limit)) && limit=$cap
    if ((limit < 15)); then
        echo "$name: skipped, out of time (${limit}s left)" | tee -a "$SUMMARY"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    [[ -n ${DRY:-} ]] && return 0
    timeout --kill-after=5 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT" || { ((rc != 0)) && verdict=FAILED; }
    echo "$name: $verdict (exit $rc, $((SECONDS - began)) s)" | tee -a "$SUMMARY"
    [[ $verdict != ok ]] && tail -n 8 "$WORK/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    pack
}

CSWAP=(python3 -m cswap_lightning)
ENGINE=(env CSWAP_CUDA_CODECS=1 "${CSWAP[@]}")
if compgen -G ".whl/*.whl" >/dev/null; then
    step install-wheels 40 python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
step environment 20 bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, \
    torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version | tail -2'
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
    awk '{print tolower($2)}')
TAG=${GPU:-gpu}-$(date +%F)
step build-ext 60 "${CSWAP[@]}" build-ext
# The codec kernels against the reference first: a kernel that faults would take the measure
# step's process (every model in it) down with it, so without a pass the engine's steps run
# on the reference codecs (the codec step still measures the kernels, in a process of its own).
step kernels 60 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_cuda_ext.py \
    -k "gpu_matches_reference or gpu_lossy_matches_reference or misaligned or views_and_special or gpu_exponent"
if [[ -z ${DRY:-} ]] && selected kernels && ! grep -q "^kernels: ok" "$SUMMARY"; then
    ENGINE=("${CSWAP[@]}")
    echo "kernels did not pass: the engine's steps run on the reference codecs" | tee -a "$SUMMARY"
fi
# Named tests first: by default those changed since a GPU last ran them (the current stream
# found again, not made anew per moved tensor; a compressed swap's memory against a raw one's,
# bounded by the design; the recipe test past CUDA's plain-timed step; whole blocks run first
# without autograd on CUDA only when asked; the allocator's peaks with layers recomputed,
# after the reference-cycle fix);
# TESTS='tests/test_x.py::test_y ...' names others, TESTS=' ' none.
TESTS=${TESTS-tests/test_transfer.py::test_on_cuda_dense_bfloat16_activations_swap_through_the_exponent_kernels_bitwise tests/test_transfer.py::test_the_current_stream_is_torchs_own_found_again tests/test_capture.py::test_on_cuda_a_leaf_is_timed_by_its_kernels_not_by_a_slower_host tests/test_allocator.py::test_on_cuda_the_counters_are_torchs tests/test_transfer.py::test_a_compressed_swap_holds_at_most_two_payload_buffers_more_than_a_raw_one tests/test_recipes.py::test_recipe_on_gpu_moves_activations_off_the_device tests/test_recompute.py::test_on_cuda_training_with_recomputed_blocks_is_bitwise_plain_training tests/test_recompute.py::test_on_cuda_the_allocators_peak_drops_with_recomputed_layers tests/test_selective.py::test_on_cuda_the_allocators_peak_drops_by_what_the_layers_no_longer_keep tests/test_selective.py::test_on_cuda_layers_below_the_layer_are_bitwise_plain_training tests/test_selective.py::test_the_host_arena_serves_the_next_step_while_the_last_ones_loss_lives[cuda]}
if [[ -n ${TESTS// /} ]]; then
    step tests 90 python3 -m pytest -q -p no:cacheprovider $TESTS
fi
step finetune 300 "${ENGINE[@]}" bench finetune llama-3-8b --lora --seq ${FT_SEQ:-8192} \
    --steps 5 --lossy int8 --dense --peers --out "$WORK/finetune-$TAG"
[[ -f $WORK/finetune-$TAG.md ]] && grep "^|" "$WORK/finetune-$TAG.md" >>"$SUMMARY"
step measure 300 "${ENGINE[@]}" bench measure --models ${MODELS:-gpt2-medium resnet50} --rounds 12 \
    --trace --out "$WORK/measure-$TAG"
[[ -f $WORK/measure-$TAG.md ]] && grep "^|" "$WORK/measure-$TAG.md" >>"$SUMMARY"
# each profile's capture: its hooked forward against the plain one, the host's and the head start
[[ -f $WORK/measure.log ]] && grep "^capture " "$WORK/measure.log" >>"$SUMMARY"
step measure-llama 150 "${ENGINE[@]}" bench measure --models llama3-8b-4l --rounds 10 --trace \
    --out "$WORK/measure-llama-$TAG"
[[ -f $WORK/measure-llama-$TAG.md ]] && grep "^| Llama" "$WORK/measure-llama-$TAG.md" >>"$SUMMARY"
[[ -f $WORK/measure-llama.log ]] && grep "^capture " "$WORK/measure-llama.log" >>"$SUMMARY"
step codec 40 "${ENGINE[@]}" bench codec --sizes 16MiB 64MiB --codecs zvc rle exponent int8 fp8 \
    --sparsities 0 50 90 --no-relu --no-nvcomp --out "$WORK/codec-$TAG"
step selective 150 python3 benchmarks/selective.py --device cuda --layers 4 --seq 4096 \
    --repeats 5 --profile --out "$WORK/selective-$TAG"
step overhead 60 "${ENGINE[@]}" bench overhead --device cuda --rounds 5 --steady-steps 3 \
    --out "$WORK/overhead-$TAG"
[[ -f $WORK/overhead-$TAG.md ]] && grep -E "^\| cswap plan=raw|allocator" "$WORK/overhead-$TAG.md" \
    >>"$SUMMARY"
step exit-codes 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_exit.py
step pytest-gpu 150 python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 60 \
    --ignore tests/test_exit.py --junitxml="$WORK/pytest-gpu.xml"  # the exit-codes step ran it
step measure-more 200 "${ENGINE[@]}" bench measure --models bert-large vgg16 --rounds 10 \
    --trace --out "$WORK/measure-more-$TAG"
step finetune-qlora 240 "${ENGINE[@]}" bench finetune llama-3-8b --qlora --seq ${FT_SEQ:-8192} \
    --steps 5 --peers --out "$WORK/finetune-qlora-$TAG"
[[ -f $WORK/finetune-qlora-$TAG.md ]] && grep "^|" "$WORK/finetune-qlora-$TAG.md" >>"$SUMMARY"
pack
echo "done in $SECONDS s; in $OUT:"
ls -la "$OUT"
