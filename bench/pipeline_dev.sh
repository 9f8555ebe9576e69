#!/usr/bin/env bash
# The docs/pipeline.md pipeline with everything chosen on a dev split carved from the training data
# (issue 28): the bi-encoder's best step on dev/ndcg@10, negatives mined with it, a reranker whose
# step, fusion weight and top k are the best on the same held-out queries (dev_best/ndcg@10), then
# scored once on data/eval and data/ood. Usage: bash bench/pipeline_dev.sh SEED OUT_DIR
# (about 30 min per seed on a 2-core CPU). Each step prints its wall-clock time.
set -euo pipefail
seed=${1:?seed}; out=${2:?output dir}
mkdir -p "$out"
dev="--seed $seed --dev-queries 200 --dev-corpus-size 2000"
t() { local s=$SECONDS; "$@"; echo "[pipeline_dev] $(( SECONDS - s )) s: $*" >&2; }
t torchrun --nproc_per_node=2 train_biencoder.py $dev --select-best dev/ndcg@10 --output-dir "$out/biencoder"
t python -m retrieval_kit.mine --input data/train.jsonl --model "$out/biencoder/final" --k 15 \
    --out "$out/reranker_train.jsonl"
t torchrun --nproc_per_node=2 train_reranker.py --force-fp32-params --static-graph $dev \
    --train-file "$out/reranker_train.jsonl" --n-passages 8 --max-steps 150 --warmup-steps 30 --val-every 50 \
    --dev-biencoder "$out/biencoder/final" --select-best dev_best/ndcg@10 --output-dir "$out/reranker"
for set in eval ood; do
    t python -m retrieval_kit.evaluate --beir "data/$set" --model "$out/biencoder/final" \
        --output "$out/$set.biencoder.json"
    t python -m retrieval_kit.evaluate --beir "data/$set" --model "$out/biencoder/final" \
        --reranker "$out/reranker/final" --output "$out/$set.pipeline.json"
done
