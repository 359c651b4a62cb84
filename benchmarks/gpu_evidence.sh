#!/usr/bin/env bash
# Collect the GPU evidence in three calls of the device machine, one after the other in one
# 30-minute session (each part ends within its 470 s budget plus a few seconds of packing;
# the three, with the machine's start, take about 27 minutes):
#   part 1: the CUDA codec build, `pytest -m gpu`, tests/test_exit.py (the exit codes, all its
#           cases, on their own line), compute-sanitizer memcheck on a short codec run,
#           `cswap bench codec` (full sizes, with nvCOMP when its wheels were carried), and
#           `cswap bench step` for the CNN and the transformer;
#   part 2: `cswap bench advisor`, `cswap bench overhead --device cuda`, `cswap compare` on
#           BERT-base (lossless against int8), and `cswap bench suite` on ResNet-50 and VGG-16;
#   part 3: `cswap bench suite` on BERT-large and GPT-2 medium (300 s), and `cswap tune`.
# Issue 13's suite on the CNNs gets what is left of part 2; each suite's --time-budget is its
# step's limit less 25 s, and what that budget did not reach is marked so in suite.md. Each
# step has its own time limit, capped by what is left of the part's budget; a failing or
# timed-out step is recorded (with the end of its log) and the part goes on. Every part
# installs the wheels and builds the extension first: both are quick when the machine is
# still warm from the part before.
#
# How to call it (from a session whose `status` says a device machine is lent):
#   1. Once, here, in the repository root, fetch the wheels the device image lacks
#      (it has torch 2.11/CUDA 13, lightning, transformers 5.17, torchmetrics, scikit-learn,
#      pytest, nvcc, compute-sanitizer; no DALI, no internet):
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
#      the suite reports torchtune as skipped.
#   2. Three run calls, each right after the previous one returns (a machine stays warm for
#      30 s; a cold one costs a minute or two more to start):
#        run(command="PART=1 bash benchmarks/gpu_evidence.sh", carry=[".whl"], timeout_s=540)
#        run(command="PART=2 bash benchmarks/gpu_evidence.sh", carry=[".whl"], timeout_s=540)
#        run(command="PART=3 bash benchmarks/gpu_evidence.sh", carry=[".whl"], timeout_s=540)
#      A step a part did not reach (its summary says "out of time") or that timed out can run
#      again in a later call: run(command="ONLY='install-wheels build-ext tune' bash
#      benchmarks/gpu_evidence.sh", carry=[".whl"], timeout_s=540).
#   3. What each call brings back (files_at), two files: summary-part<N>.txt (each step's exit
#      code and time, the end of the log of each that failed, pytest's totals, the codec
#      summary, the suite's verdicts) and evidence-part<N>.tar.gz (a folder evidence-part<N>/
#      with every step's log, the pytest junit XML and the result files: markdown, JSON, PNG,
#      named for benchmarks/results/). Training runs write their checkpoints and logs to a
#      scratch folder that stays on the machine, and no file over 8 MiB goes into the tarball
#      (the summary names any left out), so it stays under the 16 MiB a returned file may be.
#      Commit the result files under benchmarks/results/.
#
# Environment: PART (1, 2 or 3), OUT (where the two files go; the device machine sets it),
# BUDGET_S (the part's seconds, default 470), ONLY (space-separated step names to run, of any
# part, instead of a PART), DRY=1 (list each step with its limit and command, run nothing:
# checks the plan on a machine without a GPU, e.g. `DRY=1 PART=2 bash benchmarks/gpu_evidence.sh`).
set -u
cd "$(dirname "$0")/.." || exit 1
if [[ -n ${ONLY:-} ]]; then
    LABEL=only
elif [[ ${PART:-} == [123] ]]; then
    LABEL=part$PART
else
    echo "gpu_evidence.sh: set PART=1, 2 or 3, or ONLY='step ...' (got PART='${PART:-}')" >&2
    exit 2
fi
OUT=${OUT:-$PWD/gpu-evidence-out}
TMP=$(mktemp -d /tmp/gpu-evidence.XXXXXX)
WORK=$TMP/evidence-$LABEL  # logs and result files: what comes back
SCRATCH=$TMP/scratch  # what training runs write (checkpoints, Lightning logs): stays here
SUMMARY=$WORK/summary-$LABEL.txt
DEADLINE=$((SECONDS + ${BUDGET_S:-470}))
RESERVE=15  # seconds kept for packing the results
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK" "$SCRATCH"

# in_part N: whether this call runs part N's steps (with ONLY, every part's: ONLY picks).
in_part() { [[ -n ${ONLY:-} || $PART == "$1" ]]; }

# selected NAME: whether step NAME runs (each of the part's, unless ONLY names some).
selected() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* ]]; }

# skip NAME WHY: record that step NAME, if selected, cannot run here.
skip() { selected "$1" && echo "$1: skipped, $2" | tee -a "$SUMMARY"; }

# limit_for NAME CAP [MIN]: print the step's time limit, CAP or what is left of the budget if
# less; fail, and say so in the summary, when less than MIN seconds (default 10) are left.
limit_for() {
    local left=$((DEADLINE - SECONDS - RESERVE))
    if ((left < ${3:-10})); then
        echo "$1: skipped, out of time (${left}s left)" | tee -a "$SUMMARY" >&2
        return 1
    fi
    echo $(($2 < left ? $2 : left))
}

# step NAME CAP COMMAND...: run COMMAND with a time limit (see limit_for), output to
# $WORK/NAME.log; its exit code and time, and the end of its log if it failed, to the summary.
step() {
    local name=$1 began=$SECONDS limit rc verdict=ok
    selected "$name" || return 0
    limit=$(limit_for "$name" "$2") || return 0
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    if [[ -n ${DRY:-} ]]; then
        return 0
    fi
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    if ((rc == 124 || rc == 137)); then
        verdict="TIMED OUT"
    elif ((rc != 0)); then
        verdict=FAILED
    fi
    echo "$name: $verdict (exit $rc, $((SECONDS - began)) s)" | tee -a "$SUMMARY"
    if [[ $verdict != ok ]]; then
        tail -n 5 "$WORK/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
}

# pytest_step NAME CAP ARGS...: pytest ARGS as step NAME; its totals line to the summary.
pytest_step() {
    local name=$1 cap=$2
    shift 2
    step "$name" "$cap" python3 -m pytest -q -p no:cacheprovider "$@"
    if [[ -f $WORK/$name.log ]]; then
        grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran" \
            "$WORK/$name.log" | tail -n 1 | sed "s/^/$name: /" | tee -a "$SUMMARY"
    fi
}

# suite NAME CAP MODEL...: `cswap bench suite` on the full-size MODELs as step NAME, its time
# budget 25 s under the step's limit (for the report and the run in progress when it ends);
# its report in $WORK/suite-<models>-$TAG/ (NAME without "bench-").
suite() {
    local name=$1 cap=$2 limit report=$WORK/${1#bench-}-$TAG
    shift 2
    selected "$name" || return 0
    limit=$(limit_for "$name" "$cap" 60) || return 0
    step "$name" "$limit" "${ENGINE[@]}" bench suite --models "$@" --steps 3 \
        --time-budget $((limit - 25)) --out "$report"
    if [[ -f $report/suite.md ]]; then
        grep -hE "^- (PASS|FAIL|n/a)|^Verdict" "$report/suite.md" | tee -a "$SUMMARY"
    fi
}

# pack: the logs and result files (no checkpoints, no weights), each under 8 MiB, into
# $OUT/evidence-$LABEL.tar.gz, and the summary beside it.
pack() {
    local files=$TMP/files tarball=$OUT/evidence-$LABEL.tar.gz left_out
    (cd "$TMP" && find "evidence-$LABEL" -type f \( -name '*.log' -o -name '*.xml' \
        -o -name '*.md' -o -name '*.json' -o -name '*.png' -o -name '*.txt' -o -name '*.csv' \
        \) -size -8192k | sort) >"$files"
    left_out=$(cd "$TMP" && find "evidence-$LABEL" -type f | sort | comm -23 - "$files")
    if [[ -n $left_out ]]; then
        { echo "left out of the tarball (not a log or result file, or 8 MiB or more):"
          echo "$left_out" | sed 's/^/    /'; } | tee -a "$SUMMARY"
    fi
    tar czf "$tarball" -C "$TMP" -T "$files"
    if (($(stat -c %s "$tarball") >= 16 << 20)); then
        echo "WARNING: $tarball is over the 16 MiB a returned file may be" | tee -a "$SUMMARY"
    fi
    cp "$SUMMARY" "$OUT"/
}

CSWAP=(python3 -m cswap_lightning)  # the package is used from this checkout, not installed
# The engine-level runs use the CUDA codecs (opt-in until this evidence is in).
ENGINE=(env CSWAP_CUDA_CODECS=1 "${CSWAP[@]}")

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
    python3 -m pip list 2>/dev/null | \
    grep -iE "torch|lightning|transformers|nvcomp|hyperopt|jsonargparse|dali"'
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
    awk '{print tolower($2)}')
TAG=${GPU:-gpu}-$(date +%F)
step build-ext 180 "${CSWAP[@]}" build-ext  # cached per source and toolkit: quick once built

if in_part 1; then
    pytest_step pytest-gpu 240 -m gpu --continue-on-collection-errors \
        --junitxml="$WORK/pytest-gpu.xml"
    if [[ -f tests/test_exit.py ]]; then  # all its cases, reported on their own line
        pytest_step exit-codes 90 tests/test_exit.py
    else
        skip exit-codes "this checkout has no tests/test_exit.py"
    fi
    SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    if [[ -x $SANITIZER ]]; then
        # Element counts that are not multiples of 32 (1028 bytes) exercise the kernels' tails.
        step memcheck 90 "$SANITIZER" --tool memcheck --error-exitcode 3 "${CSWAP[@]}" \
            bench codec --sizes 1028 1MiB --quick --no-relu --no-nvcomp --repeats 1
    else
        skip memcheck "compute-sanitizer not found"
    fi
    step bench-codec 180 "${CSWAP[@]}" bench codec --out "$WORK/codec-$TAG"
    if [[ -f $WORK/codec-$TAG.md ]]; then
        sed -n '/^## Target/,$p' "$WORK/codec-$TAG.md" | tee -a "$SUMMARY"
    fi
    step bench-step-cnn 60 "${ENGINE[@]}" bench step --model cnn --out "$WORK/step-$TAG-cnn"
    step bench-step-transformer 60 "${ENGINE[@]}" bench step --model transformer \
        --out "$WORK/step-$TAG-transformer"
fi

if in_part 2; then
    step bench-advisor 60 "${ENGINE[@]}" bench advisor
    # Issue 12 on a GPU: the engine's host time per saved tensor where it launches the kernels.
    step bench-overhead 90 "${ENGINE[@]}" bench overhead --device cuda --rounds 5 \
        --steady-steps 3 --out "$WORK/overhead-$TAG"
    # Issue 6 on a GPU: BERT-base, one short epoch lossless then int8; memory, link bytes, step
    # time. Its checkpoints and Lightning logs go to the scratch folder.
    step compare-bert-base 150 "${ENGINE[@]}" compare --lossy int8 \
        --out "$WORK/compare-bert-base-int8-$TAG" --config recipes/bert.yaml \
        --data.num_samples 640 --trainer.max_epochs 1 --trainer.limit_val_batches 4 \
        --trainer.enable_progress_bar false --trainer.default_root_dir "$SCRATCH/compare"
    # Issue 13: every method at 100/50/35% of no offload's memory and the largest batch, on
    # the full-size models, bf16; progress lines go to the step's log as it runs.
    suite bench-suite-cnn 470 resnet50 vgg16
fi

if in_part 3; then
    suite bench-suite-transformers 300 bert-large gpt2-medium
    step tune 150 "${CSWAP[@]}" tune --out "$WORK/tune-$TAG"  # the rest: 135 s or more
fi

pack
echo "evidence in $OUT:"
find "$OUT" -maxdepth 1 -type f
