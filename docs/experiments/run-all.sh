#!/usr/bin/env bash
# Regenerates every table and figure of docs/experiments.md (about 8 minutes on 2 cores).
# Each experiment is one `crowdgrad sim --sweep`; it writes summary.csv, summary.md, sweep.svg
# and one run.csv per value into docs/experiments/<name>/ (the per-run run.svg is removed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
cargo build --release -p crowdgrad
sim() { target/release/crowdgrad sim --quiet "$@"; }
out=docs/experiments
# Every run: 300k training examples (5 epochs of MNIST), evaluated on the full test set every 10k.
budget=(--samples 300000 --eval-every 10000 --eval-subset 0)

# 1. Consistency modes for 1, 4 and 16 workers.
for k in 1 4 16; do
  sim --workers "$k" "${budget[@]}" --out "$out/modes-k$k" --sweep "mode=async,ssp:2,sync:$k"
done
# 2. Staleness policies with 16 async workers, at the default learning rate and at 8x it.
for lr in 0.05 0.4; do
  sim --workers 16 --lr "$lr" "${budget[@]}" --out "$out/staleness-k16-lr$lr" \
    --sweep "staleness=accept;drop:12;scale;scale:abs;dc:1000"
done
# 3. Sync with 16 workers is a 16x larger batch: raise the learning rate.
sim --workers 16 --mode sync:16 "${budget[@]}" --out "$out/sync16-lr" --sweep "lr=0.05,0.2,0.4,0.8"
# 4. Two faulty workers out of 16.
sim --workers 16 --faulty 0.125 "${budget[@]}" --out "$out/faulty-k16" \
  --sweep "fault=nan,noise,scale:10,scale:1000"
# 5. Workers leave every ~20 s for ~10 s: closing the tab vs a sleeping laptop.
for kind in disconnect pause; do
  sim --workers 16 --dropout-every 20 --away 10 --dropout-kind "$kind" "${budget[@]}" \
    --out "$out/dropout-$kind-k16" --sweep "mode=async,ssp:2,sync:16"
done
# 6. Is the policy ranking luck? Three more seeds.
for seed in 1 2 3; do
  sim --workers 16 --seed "$seed" "${budget[@]}" --out "$out/seeds/seed$seed" \
    --sweep "staleness=accept;drop:12;dc:1000"
done
find "$out" -name run.svg -delete
# 7. Training over home internet links (issue 8): 16 workers, each on its own 20 Mbit/s link with
# 20 ms latency; f32 every step, compressed, local steps, auto, synchronous DiLoCo; 3 seeds each.
# Written after the clean-up above: seed 1 keeps its run.svg (the lesson shows them).
link=(--workers 16 --mbps 20 --delay-ms 20)
compressed=(--pull-encoding bf16 --push-encoding int8_block)
home() {
  local name=$1
  shift
  for seed in 1 2 3; do
    sim "${link[@]}" "${budget[@]}" --seed "$seed" "$@" --out "$out/home-link/$name/seed$seed"
  done
  rm -f "$out/home-link/$name"/seed[23]/run.svg
}
home f32-h1 --local-steps 1 --pull-encoding f32 --push-encoding f32 --overlap off
home int8-h1 --local-steps 1 "${compressed[@]}" --overlap off
home int8-h1-overlap --local-steps 1 "${compressed[@]}" --overlap on
home int8-h32 --local-steps 32 "${compressed[@]}"
home int8-auto --local-steps auto "${compressed[@]}"
home diloco-h32 --consistency sync:16 --local-steps 32 "${compressed[@]}"
