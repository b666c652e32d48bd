#!/usr/bin/env bash
# v12 (issue 46): does training on the blocks greedy decoding visits lift the head where decoding uses it?
# 1. the anchors v11's drafter (argmax, head off) visits when greedy decoding walks training rows 0..1599 (25 min);
# 2. v11 continued 400 steps (one pass over those rows) with anchors drawn from them (ANCHORS=visited), and the
#    control, the same run with anchors drawn uniformly (ANCHORS=uniform). 11 min each alone on 2 cores;
# 3. the control again on 1,600 rows v10-v12 never read (rows 4000..5599 of the same shuffle of the five sets; their
#    cache 9 min, the run 11 min).
# Run from the repository root, with v11's folders in runs/v11 (docs/runs/smollm2-v11/run.sh, runs/v11/compact.py:
# `compact_token_table()`, saved in bf16).
set -euo pipefail
RECORD=docs/runs/smollm2-v12
export PYTHONPATH=.
[ -f runs/v12/visited.json ] || .venv/bin/python $RECORD/visited_anchors.py runs/v11/xpress-compact \
  cache/signals-smollm2-v10 0 1600 runs/v12/visited.json
TARGET=$(.venv/bin/python -c "from modeling_xpress.bench.assets import smollm2_dir; print(smollm2_dir())")
DATA=data/smollm2_task_responses,data/smollm2_task_responses_3200-4800,data/smollm2_mined_responses,data/smollm2_mined_responses_1600-3000,data/smollm2_responses
continue_v11() {  # the arguments that differ between the runs, then v11's continuation
  .venv/bin/python $RECORD/continue_v11.py "$@" --target "$TARGET" --target_dtype bfloat16 --bf16 --data "$DATA" \
    --train_rows_seed 0 --init_from runs/v11/xpress-r256 --refiner xpress --refiner_form release \
    --refiner_rank 256 --refiner_mlp_hidden 512 --train_mode full --consistency_weight 1.0 \
    --anchor_weight_start 0.2 --anchor_weight_floor 0.2 --learning_rate 3e-4 --drafter_lr_scale 0.15 \
    --lr_scheduler_type cosine --warmup_steps 10 --max_steps 400 --per_device_train_batch_size 4 \
    --anchors_per_sequence 32 --max_seq_length 640 --logging_steps 10 --save_strategy no --report_to none --seed 1 \
    --threads 2 --eval_held_out 100 --eval_strategy no
}
for ANCHORS in visited uniform; do
  ROWS=1600 ANCHORS=$ANCHORS VISITED=runs/v12/visited.json continue_v11 --max_train_samples 4000 \
    --signal_cache cache/signals-smollm2-v10 --output_dir runs/v12/$ANCHORS
done
ROWS=1600 FIRST=4000 ANCHORS=uniform continue_v11 --max_train_samples 10200 \
  --signal_cache cache/signals-smollm2-rows4000-5600 --output_dir runs/v12/new-rows
