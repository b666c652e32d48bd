#!/usr/bin/env bash
# v11 (issue 46): v9's drafter co-trained with a fresh authors' head at the authors' size (rank 256, MLP 512),
# the authors' recipe but the consistency term at weight 1.0 (run 4 of v10: the only change that moved the
# free-running estimate), head lr 1e-3 / drafter 0.15 of it (run 2), 1,500 steps. Resumable: rerun this script.
set -euo pipefail
cd /work/train-v11
export PYTHONPATH=/work/train-v11
TARGET=$(/work/main/.venv/bin/python -c "from modeling_xpress.bench.assets import smollm2_dir; print(smollm2_dir())")
DATA=data/smollm2_task_responses,data/smollm2_task_responses_3200-4800,data/smollm2_mined_responses,data/smollm2_mined_responses_1600-3000,data/smollm2_responses
OUT=/work/main/runs/v11/${NAME:-xpress-r256}
RESUME=()
last=$(ls -d $OUT/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 || true)
if [ -n "$last" ]; then RESUME=(--resume_from_checkpoint "$last"); fi
exec /work/main/.venv/bin/python examples/train_refiner.py --target "$TARGET" --target_dtype bfloat16 --bf16 \
  --data "$DATA" --max_train_samples 4000 --train_rows_seed 0 --signal_cache /work/main/cache/signals-smollm2-v10 \
  --init_from checkpoints/xpress-smollm2-135m-instruct --refiner xpress --refiner_form release \
  --refiner_rank ${RANK:-256} --refiner_mlp_hidden ${MLP:-512} --train_mode full --consistency_weight ${CW:-1.0} \
  --learning_rate ${LR:-1e-3} --drafter_lr_scale ${SCALE:-0.15} --lr_scheduler_type cosine --warmup_steps 30 \
  --max_steps ${STEPS:-1500} --per_device_train_batch_size 4 --anchors_per_sequence 32 --max_seq_length 640 \
  --logging_steps 5 --save_steps 150 --save_total_limit 2 --report_to none --seed 0 --threads 2 \
  --eval_held_out 100 --eval_strategy steps --eval_steps 150 --per_device_eval_batch_size 4 \
  --load_best_model_at_end true --metric_for_best_model eval_tau_estimate_jacobi --greater_is_better true \
  --early_stopping_patience 3 --output_dir $OUT "${RESUME[@]}"
