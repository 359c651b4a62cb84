#!/usr/bin/env bash
# Collect every piece of GPU evidence in ONE call of the device machine (10-minute limit):
# the CUDA codec build, `pytest -m gpu`, compute-sanitizer memcheck on a short codec run,
# `cswap bench codec` (full sizes, with nvCOMP when its wheels were carried),
# `cswap bench step` for the CNN and the transformer, `cswap bench advisor`,
# `cswap bench overhead --device cuda`, `cswap compare` on BERT-base (lossless against int8),
# `cswap tune`, and `cswap bench suite` (issue 13: ResNet-50,
# VGG-16, BERT-large, GPT-2 medium against every peer method; two steps, one per model pair).
# Each step has its own time limit, capped by what is left of the whole budget; a failing or
# timed-out step is recorded and the script goes on.
#
# How to call it (from a session whose `status` says a device machine is lent):
#   1. Once, here, in the repository root, fetch the wheels the device image lacks
#      (it has torch 2.11/CUDA 13, lightning, transformers, torchmetrics, scikit-learn, pytest,
#      nvcc, compute-sanitizer; no internet):
#        echo /.whl/ >> .git/info/exclude
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#          --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#          --platform manylinux2014_x86_64 -d .whl \
#          nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 hyperopt==0.3.0 \
#          jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.14.0
#      (about 35 MB, of the 64 MiB a call may carry). torchtune is optional: add
#      torchtune==0.6.1 torchao==0.9.0 datasets dill multiprocess kagglehub kagglesdk blobfile
#      pycryptodomex omegaconf antlr4-python3-runtime torchdata only if they fit; without them
#      the step benchmark reports torchtune as skipped.
#   2. One run call:
#        run(command="bash benchmarks/gpu_evidence.sh", carry=[".whl"], timeout_s=600)
#      and a second for what the first did not reach (the summary says "out of time"); the
#      suite's two steps (240 s each at most) normally go there:
#        run(command="ONLY='install-wheels build-ext bench-suite-cnn bench-suite-transformers' \
#            bash benchmarks/gpu_evidence.sh", carry=[".whl"], timeout_s=600)
#   3. What comes back (files_at): summary.txt (each step's exit code and time, then the codec
#      summary), evidence.tar.gz (every log, the pytest junit XML and all result files, named
#      for benchmarks/results/), the codec result as codec-<gpu>-<date>.{md,json}, and the
#      suite's reports as suite-{cnn,transformers}-<gpu>-<date>/ (suite.md, suite.json, PNGs;
#      written after every run, so a step cut off by its time limit keeps what it measured).
#      Commit the result files from the tarball under benchmarks/results/.
#
# Environment: OUT (where results go; the device machine sets it), BUDGET_S (total seconds,
# default 560, under the 600 s per-call limit), ONLY (space-separated step names to run, e.g.
# ONLY="bench-advisor compare-bert-base tune" for a second call when the first ran out of time).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-evidence-out}
WORK=$(mktemp -d /tmp/gpu-evidence.XXXXXX)
SUMMARY=$WORK/summary.txt
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))
RESERVE=15  # seconds kept for packing the results
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"

# step NAME MAX_SECONDS COMMAND...: run COMMAND with a time limit (MAX_SECONDS, or what is
# left of the budget if less), output to $WORK/NAME.log, exit code and time to the summary.
step() {
    local name=$1 limit=$2 began=$SECONDS rc
    shift 2
    if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then
        return
    fi
    local left=$((DEADLINE - SECONDS - RESERVE))
    if ((left < 10)); then
        echo "$name: skipped, out of time" | tee -a "$SUMMARY"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    local verdict=ok
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT"
    ((rc != 0 && rc != 124 && rc != 137)) && verdict=FAILED
    echo "$name: $verdict (exit $rc, $((SECONDS - began)) s)" | tee -a "$SUMMARY"
}

CSWAP=(python3 -m cswap_lightning)  # the package is used from this checkout, not installed

if compgen -G ".whl/*.whl" >/dev/null; then
    # Into the interpreter's own environment, so nvidia.nvcomp joins the installed nvidia.*
    # packages; a --target folder is the fallback where that environment is read-only.
    step install-wheels 60 bash -c 'python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir .whl/*.whl || python3 -m pip install -q --no-index \
        --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl'
    [[ -d /tmp/site ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

step environment 30 bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, \
    torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version | tail -2; \
    python3 -m pip list 2>/dev/null | grep -iE "torch|lightning|nvcomp|hyperopt|jsonargparse"'
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
    awk '{print tolower($2)}')
TAG=${GPU:-gpu}-$(date +%F)

step build-ext 120 "${CSWAP[@]}" build-ext
step pytest-gpu 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$WORK/pytest-gpu.xml"
step bench-codec 180 "${CSWAP[@]}" bench codec --out "$WORK/codec-$TAG"
# The engine-level runs below use the CUDA codecs (opt-in until this evidence is in).
export CSWAP_CUDA_CODECS=1
step bench-step-cnn 60 "${CSWAP[@]}" bench step --model cnn --out "$WORK/step-$TAG-cnn"
step bench-step-transformer 60 "${CSWAP[@]}" bench step --model transformer \
    --out "$WORK/step-$TAG-transformer"

step bench-advisor 60 "${CSWAP[@]}" bench advisor
# Issue 12 on a GPU: the engine's host time per saved tensor where it launches the kernels.
step bench-overhead 90 "${CSWAP[@]}" bench overhead --device cuda --rounds 5 --steady-steps 3 \
    --out "$WORK/overhead-$TAG"
# Issue 6 on a GPU: BERT-base, one short epoch lossless then int8; memory, link bytes, step time.
step compare-bert-base 150 "${CSWAP[@]}" compare --lossy int8 --out "$WORK/compare-bert-base-int8-$TAG" \
    --config recipes/bert.yaml --data.num_samples 640 --trainer.max_epochs 1 \
    --trainer.limit_val_batches 4 --trainer.enable_progress_bar false \
    --trainer.default_root_dir "$WORK/logs"

SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [[ -x $SANITIZER ]]; then
    # Element counts that are not multiples of 32 (1028 bytes) exercise the kernels' tails.
    step memcheck 90 "$SANITIZER" --tool memcheck --error-exitcode 3 "${CSWAP[@]}" \
        bench codec --sizes 1028 1MiB --quick --no-relu --no-nvcomp --repeats 1
else
    echo "memcheck: skipped, compute-sanitizer not found" | tee -a "$SUMMARY"
fi

if "${CSWAP[@]}" tune --help >/dev/null 2>&1; then
    step tune 90 "${CSWAP[@]}" tune --out "$WORK/tune-$TAG"
else
    echo "tune: skipped, this checkout has no 'cswap tune'" | tee -a "$SUMMARY"
fi

# Issue 13: every method at 100/50/35% of no offload's memory and the largest batch, on the
# full-size models, bf16. Each pair of models has a time budget a little under its step's limit
# (fewer timed steps; runs and batch searches left when a model's share is spent are reported
# as skipped); progress lines go to the step's log as it runs.
step bench-suite-cnn 240 "${CSWAP[@]}" bench suite --models resnet50 vgg16 --steps 3 \
    --time-budget 215 --out "$WORK/suite-cnn-$TAG"
step bench-suite-transformers 240 "${CSWAP[@]}" bench suite --models bert-large gpt2-medium \
    --steps 3 --time-budget 215 --out "$WORK/suite-transformers-$TAG"
for suite in "$WORK"/suite-*-"$TAG"; do
    [[ -d $suite ]] && cp -r "$suite" "$OUT"/ && grep -hE "^- (PASS|FAIL|n/a)|^Verdict" \
        "$suite/suite.md" | tee -a "$SUMMARY"
done

CODEC_MD=$WORK/codec-$TAG.md
if [[ -f $CODEC_MD ]]; then
    cp "$CODEC_MD" "$WORK/codec-$TAG.json" "$OUT"/
    echo | tee -a "$SUMMARY"
    sed -n '/^## Target/,$p' "$CODEC_MD" | tee -a "$SUMMARY"
fi
cp "$SUMMARY" "$OUT"/
tar czf "$OUT/evidence.tar.gz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
echo "evidence in $OUT:"
find "$OUT" -maxdepth 1 -type f
