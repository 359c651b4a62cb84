#!/usr/bin/env bash
# Lossless against lossy on the CPU-sized recipes: `cswap compare` on the CNN recipe and on a
# small BERT learning a generated task, with the int8 and int4 codecs. Results go to
# benchmarks/results/compare-*-cpu-DATE.{md,json}. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s setup
logs=$(mktemp -d)
out=benchmarks/results
common=(--trainer.enable_progress_bar false --trainer.default_root_dir "$logs")
bert=(--config recipes/bert.yaml --model.vocab_size 128 --data.vocab_size 128
      --model.hidden_size 64 --model.num_layers 2 --model.num_heads 2 --data.seq_len 32
      --data.num_samples 1024 --data.batch_size 32 --model.num_labels 64 --data.num_labels 64
      --trainer.max_epochs 4 --trainer.precision 32-true --model.optimizer.init_args.lr 0.001
      --trainer.strategy.init_args.config.min_bytes 4096)
for codec in int8 int4; do
  .venv/bin/cswap compare --lossy "$codec" --out "$out/compare-cnn-$codec-cpu-$(date +%F)" \
    --config recipes/cnn.yaml "${common[@]}"
  .venv/bin/cswap compare --lossy "$codec" --out "$out/compare-bert-$codec-cpu-$(date +%F)" \
    "${bert[@]}" "${common[@]}"
done
rm -rf "$logs"
