"""Train an xPress refiner (and co-adapt its drafter) against a frozen target with `XPressTrainer`.

One process:

    python examples/train_refiner.py --target path/to/target --init_from path/to/dflash \
        --data responses.parquet --output_dir runs/xpress --max_steps 2000 --bf16

Several processes (the script is unchanged; on a machine without GPUs add `--multi_gpu`, which makes accelerate
start torchrun-style processes, and they train on CPU with gloo):

    accelerate launch --num_processes 2 examples/train_refiner.py ...

A drafter whose layers start as the target's last ones instead of random weights
(`modeling_xpress.training.target_init`; Llama, Mistral and Qwen3 targets):

    python examples/train_refiner.py --target path/to/target --init_from_target_layers last --num_draft_layers 2 \
        --refiner none --data responses.parquet --output_dir runs/drafter --max_steps 2000 --bf16

Smoke test without any download (a tiny random Llama target and synthetic target-written data):

    python examples/train_refiner.py --target tiny-random --output_dir /tmp/xpress-smoke --max_steps 4

Train every stage from the target's signals computed once (`--signal_cache runs/signals`: written on the first run,
an interrupted one resumed, then read by this and every later stage with the same drafter layers; no target forward
while training):

    python examples/train_refiner.py --target path/to/target --data responses.parquet --signal_cache runs/signals ...

Every `--save_steps` a loadable xPress folder is written to `<output_dir>/checkpoint-<step>/`
(`XPressModel.from_pretrained(folder)`); continue an interrupted run with `--resume_from_checkpoint <folder>` (same
`--init_from` and data). All `TrainingArguments` flags work (`--learning_rate`, `--bf16`, `--logging_steps`, ...), plus
the objective's own (`--train_mode`, `--consistency_weight`, `--anchors_per_sequence`, ...; see
`modeling_xpress.training.XPressTrainingArguments`). The run itself is `modeling_xpress.training.run.train`, which
the pipeline (`python -m modeling_xpress.pipeline`) calls for each of its training stages.
"""

from transformers import HfArgumentParser

from modeling_xpress.training import XPressTrainingArguments
from modeling_xpress.training.run import RunArguments, train


def main() -> None:
    run_args, training_args = HfArgumentParser((RunArguments, XPressTrainingArguments)).parse_args_into_dataclasses()
    trainer = train(run_args, training_args)
    # Wait for every rank (rank 0 may still be writing the final folder), then tear the process group down
    # explicitly: left to interpreter exit, gloo's threads can still be running and a rank aborts with "terminate
    # called without an active exception" after the work is done.
    trainer.accelerator.wait_for_everyone()
    if training_args.world_size > 1:
        print(f"xPress training: every rank finished; rank {training_args.process_index} exiting", flush=True)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
