#!/usr/bin/env bash
# v10: the bundled v9 drafter co-trained with a fresh authors' head (release form, r=128, MLP 256: the bundled folder stays under 50 MB) by the authors'
# recipe (XPressTrainingArguments defaults: lambda 0.6->0.2, 3 consistency rounds x 0.3, 0.9 L1 + 0.1 CE, gamma 4).
set -euo pipefail
cd /work/main
TARGET=$(.venv/bin/python -c "from modeling_xpress.bench.assets import smollm2_dir; print(smollm2_dir())")
DATA=data/smollm2_task_responses,data/smollm2_task_responses_3200-4800,data/smollm2_mined_responses,data/smollm2_mined_responses_1600-3000,data/smollm2_responses
OUT=runs/v10/xpress
RESUME=()
last=$(ls -d $OUT/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 || true)
if [ -n "$last" ]; then RESUME=(--resume_from_checkpoint "$last"); fi
exec .venv/bin/python examples/train_refiner.py --target "$TARGET" --target_dtype bfloat16 --bf16 \
  --data "$DATA" --max_train_samples 4000 --train_rows_seed 0 --signal_cache cache/signals-smollm2-v10 \
  --init_from checkpoints/xpress-smollm2-135m-instruct --refiner xpress --refiner_form release \
  --refiner_rank ${RANK:-128} --refiner_mlp_hidden ${MLP:-256} --train_mode full \
  --learning_rate ${LR:-3e-4} --lr_scheduler_type cosine --warmup_steps 30 --max_steps ${STEPS:-600} \
  --per_device_train_batch_size 4 --anchors_per_sequence 32 --max_seq_length 640 \
  --logging_steps 5 --save_steps 150 --save_total_limit 2 --report_to none --seed 0 --threads 2 \
  --eval_held_out 100 --eval_strategy steps --eval_steps 150 --per_device_eval_batch_size 4 \
  --load_best_model_at_end true --metric_for_best_model eval_tau_estimate_jacobi --greater_is_better true \
  --early_stopping_patience 3 --output_dir $OUT "${RESUME[@]}"
