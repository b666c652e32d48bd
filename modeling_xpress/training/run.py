"""One training run, from its settings to a saved xPress folder: what `examples/train_refiner.py` does, as library
code that the pipeline (`modeling_xpress.pipeline`) calls for each of its training stages.

`RunArguments` are the run's own settings (the target, the data, where the drafter starts, its shape, the signal
cache); the objective's and the Trainer's are `XPressTrainingArguments`. `train(run_args, training_args)` loads the
target (unless given), the data (`load_data`: held-out rows kept apart), builds the drafter (`build_drafter`: a
fresh one, random or from the target's layers, a converted dFlash checkpoint, or an xPress folder), writes or reads
the signal cache, trains with `XPressTrainer`, resuming from `training_args.resume_from_checkpoint`, and saves the
final folder to `training_args.output_dir`.

This file does not travel with checkpoints (it imports the Trainer and `datasets`).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import (
    AutoModelForCausalLM,
    EarlyStoppingCallback,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    set_seed,
)

from ..configuration_xpress import XPressConfig
from ..modeling_xpress import XPressModel
from .arguments import XPressTrainingArguments
from .regeneration import load_response_sets, load_responses
from .signal_cache import cache_target_signals
from .target_init import init_drafter_from_target, read_more_target_layers
from .trainer import XPressTrainer, with_fresh_head
from .vocabulary import frequency_ranked_vocabulary

TINY_RANDOM = "tiny-random"


@dataclass
class RunArguments:
    target: str = field(
        metadata={"help": f"Local HF folder of the target model, or '{TINY_RANDOM}' for a tiny random Llama + synthetic data."}
    )
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file name inside --target (e.g. SmolLM2)."})
    target_dtype: str = field(default="float32", metadata={"help": "Dtype of the frozen target: float32 or bfloat16."})
    init_from: str = field(
        default="",
        metadata={"help": "A dFlash folder (converted, fresh head), an xPress folder, or empty for a fresh drafter."},
    )
    init_from_target_layers: str = field(
        default="",
        metadata={"help": "Fresh drafter only: start its layers from the target's instead of random weights, 'last' "
                  "(the target's last --num_draft_layers layers) or comma-separated layer indices, e.g. '14,29' "
                  "(modeling_xpress.training.target_init). Not with --init_from."},
    )
    data: str = field(
        default="",
        metadata={"help": "Training data: a `datasets` folder (save_to_disk), a .parquet file, a response shard folder, "
                  "or folders of regenerated responses with their meta.json (comma-separated; joined by prompt index; "
                  "the held-out prompts, modeling_xpress.training.regeneration.HELD_OUT_PROMPTS and the other "
                  "generators' held-out rows, are kept out of training)."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training rows."})
    train_rows_seed: int | None = field(
        default=None,
        metadata={"help": "With --max_train_samples: a seeded random choice of N training rows (datasets' shuffle) "
                  "instead of the first N, so a subset of comma-separated --data folders mixes their kinds (their "
                  "rows come folder by folder). The choice depends on this seed alone, so every stage given the same "
                  "seed and N reads the same rows and can share one --signal_cache of them."},
    )
    eval_held_out: int = field(
        default=0,
        metadata={"help": "Evaluate on the first N held-out rows of the --data folders (with --eval_strategy steps "
                  "--eval_steps E; eval_tau_estimate is the figure to watch)."},
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={"help": "Stop when eval_tau_estimate has not improved for this many evaluations (transformers' "
                  "EarlyStoppingCallback; needs --eval_held_out) and keep the best checkpoint."},
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Fresh drafter: draft only the N most frequent response tokens of the training rows (EOS "
                  "always included; XPressConfig.draft_vocab_size). Verification stays lossless."},
    )
    # Head and drafter shape (a fresh drafter uses all of them; a dFlash checkpoint only the head ones).
    refiner: str | None = field(
        default=None,
        metadata={"help": "xpress, markov or none; default: xpress, or the --init_from xPress folder's own (another value "
                  "keeps that folder's drafter and starts a fresh head)."},
    )
    refiner_rank: int = field(default=256, metadata={"help": "Low rank r of the refiner / Markov head."})
    refiner_form: str | None = field(
        default=None,
        metadata={"help": "The xPress head's function: release (the authors', default for a fresh head) or paper "
                  "(XPressConfig.refiner_form)."},
    )
    refiner_mlp_hidden: int | None = field(
        default=None, metadata={"help": "The xPress head's MLP width (default 2 x --refiner_rank; the authors': 512)."}
    )
    block_size: int = field(default=16, metadata={"help": "Fresh drafter: tokens per block, anchor included."})
    num_draft_layers: int = field(default=5, metadata={"help": "Fresh drafter: number of decoder layers."})
    target_layer_ids: str = field(
        default="",
        metadata={"help": "Fresh drafter: comma-separated target layers it reads as context, e.g. '1,27' (default: "
                  "dFlash's rule for --num_draft_layers). A signal cache holds the features of one such list, so a "
                  "deeper drafter can reuse a shallower one's cache by passing that cache's layers. With an xPress "
                  "--init_from: the layers it reads now plus more, e.g. '1,10,18,27' for one reading '1,27' "
                  "(modeling_xpress.training.target_init.read_more_target_layers: the same function at the first "
                  "step)."},
    )
    draft_intermediate_size: int | None = field(default=None, metadata={"help": "Fresh drafter: MLP width (default: target's)."})
    mask_token_id: int | None = field(default=None, metadata={"help": "Fresh drafter: mask token id (default: learned vector)."})
    threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads per process (1 is much faster on a busy CPU)."}
    )
    signal_cache: str = field(
        default="",
        metadata={"help": "Folder of the target's cached signals (modeling_xpress.training.signal_cache): written "
                  "once from --data (an unfinished one is resumed), then training runs no target forward."},
    )
    signal_cache_top_k: int = field(default=64, metadata={"help": "Top-k probabilities of p^t kept per position."})
    signal_cache_dtype: str = field(default="bfloat16", metadata={"help": "Dtype of the cached features."})


def tiny_random_target(seed: int) -> LlamaForCausalLM:
    """A 4-layer, 64-wide random Llama with a 128-token vocabulary: enough to exercise the whole pipeline."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def synthetic_responses(target, num_rows: int = 64, prompt_length: int = 8, response_length: int = 40, seed: int = 0):
    """Random prompts answered by the target itself (sampled), with the loss mask on the answers only."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (num_rows, prompt_length), generator=g)
    torch.manual_seed(seed)
    out = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        max_new_tokens=response_length,
        min_new_tokens=response_length,
        pad_token_id=0,
    )
    mask = [0] * prompt_length + [1] * response_length
    return datasets.Dataset.from_dict({"input_ids": out.tolist(), "loss_mask": [mask] * num_rows})


def floating_dtype(name: str, option: str) -> torch.dtype:
    """The torch floating-point dtype called `name` ("float32", "bfloat16", ...); the error names the option."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{option} must name a torch floating-point dtype, e.g. float32 or bfloat16; got {name!r}")
    return dtype


def load_target(args: RunArguments, seed: int) -> PreTrainedModel:
    if args.target == TINY_RANDOM:
        return tiny_random_target(seed)
    dtype = floating_dtype(args.target_dtype, "--target_dtype")
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, **kwargs).eval()


def load_data(args: RunArguments, target, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train rows, held-out rows or None). Folders of regenerated responses (with their `meta.json`) are joined by
    prompt index, and their held-out prompts go to the second set only (`regeneration.load_response_sets`)."""
    held_out = None
    parts = [part for part in args.data.split(",") if part]
    if not parts:
        if args.target != TINY_RANDOM:
            raise ValueError(
                "--data is required (regenerate responses with modeling_xpress.training.regeneration first)"
            )
        data = synthetic_responses(target, seed=seed)
    elif len(parts) > 1 or (Path(parts[0]) / "meta.json").is_file():
        data, held_out = load_response_sets(parts)
        data, held_out = data.remove_columns("prompt_index"), held_out.remove_columns("prompt_index")
    else:
        path = Path(parts[0])
        if path.is_dir() and (path / "dataset_info.json").is_file():
            data = datasets.load_from_disk(str(path))
        elif path.suffix == ".parquet":
            data = datasets.Dataset.from_parquet(str(path))
        else:  # a shard folder written by regenerate_responses
            data = load_responses(path)
    missing = {"input_ids", "loss_mask"} - set(data.column_names)
    if missing:
        raise ValueError(f"{args.data or 'the data'} lacks the columns {sorted(missing)}; need input_ids and loss_mask")
    if args.train_rows_seed is not None and args.max_train_samples is None:
        raise ValueError("--train_rows_seed chooses which --max_train_samples rows to use; pass --max_train_samples N")
    if args.max_train_samples is not None:
        if args.train_rows_seed is not None:
            data = data.shuffle(seed=args.train_rows_seed)
        data = data.select(range(min(args.max_train_samples, len(data))))
    if args.eval_held_out:
        if held_out is None or len(held_out) == 0:
            raise ValueError("--eval_held_out needs --data folders of regenerated responses that include held-out prompts")
        held_out = held_out.select(range(min(args.eval_held_out, len(held_out))))
    return data, held_out if args.eval_held_out else None


def integer_list(value: str, option: str, alternative: str = "") -> list[int]:
    """Comma-separated integers, e.g. '1,27'; the error names the option (and an `alternative` spelling)."""
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"{option} must be {alternative}comma-separated integers, got {value!r}") from None


def copied_target_layers(value: str) -> str | list[int]:
    """`--init_from_target_layers`: 'last' or comma-separated target layer indices."""
    return value if value == "last" else integer_list(value, "--init_from_target_layers", "'last' or ")


def draft_vocabulary(data, size: int, target) -> torch.Tensor:
    """The `size` most frequent response tokens of `data`, the target's EOS ids always among them: a fresh drafter's
    draft vocabulary (`XPressModel.set_draft_vocabulary`)."""
    eos = target.generation_config.eos_token_id
    always = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return frequency_ranked_vocabulary(data, size, always=always)


def build_drafter(args: RunArguments, target, data, draft_token_ids: torch.Tensor | None = None) -> XPressModel:
    """Fresh drafter (random, or starting from the target's layers), a converted dFlash checkpoint, or an existing
    xPress checkpoint (`--init_from`). A fresh drafter with `--draft_vocab_size` drafts `draft_token_ids` when they are
    given (a vocabulary ranked beforehand), else the most frequent response tokens of `data`."""
    head = {"refiner_rank": args.refiner_rank}
    if args.refiner is not None:
        head["refiner"] = args.refiner
    for name in ("refiner_form", "refiner_mlp_hidden"):
        if getattr(args, name) is not None:
            head[name] = getattr(args, name)
    if args.init_from and args.init_from_target_layers:
        raise ValueError(
            "--init_from (a checkpoint) and --init_from_target_layers (the target's own layers) both say where the "
            "drafter starts: pass one of them"
        )
    if not args.init_from:
        shape = dict(block_size=args.block_size, num_hidden_layers=args.num_draft_layers, mask_token_id=args.mask_token_id)
        if args.draft_intermediate_size is not None:
            shape["intermediate_size"] = args.draft_intermediate_size
        if args.target_layer_ids:
            shape["target_layer_ids"] = integer_list(args.target_layer_ids, "--target_layer_ids")
        if args.draft_vocab_size is not None:
            shape["draft_vocab_size"] = args.draft_vocab_size
        model = XPressModel(XPressConfig.from_target_config(target.config, **shape, **head))
        if args.draft_vocab_size is not None:
            ids = draft_token_ids if draft_token_ids is not None else draft_vocabulary(data, args.draft_vocab_size, target)
            model.set_draft_vocabulary(ids)
        if args.init_from_target_layers:
            init_drafter_from_target(model, target, copied_target_layers(args.init_from_target_layers))
        return model
    if args.draft_vocab_size is not None:
        raise ValueError("--draft_vocab_size shapes a fresh drafter; --init_from keeps the checkpoint's vocabulary")
    folder = Path(args.init_from)
    config = json.loads((folder / "config.json").read_text())
    if args.target_layer_ids and config.get("model_type") != "xpress":
        raise ValueError("--target_layer_ids with --init_from widens an xPress checkpoint's context; a dFlash "
                         "checkpoint keeps its own target layers")  # fmt: skip
    if config.get("model_type") == "xpress":
        model = XPressModel.from_pretrained(folder)
        if args.target_layer_ids:
            model = read_more_target_layers(model, integer_list(args.target_layer_ids, "--target_layer_ids"))
        fields = ("refiner", "refiner_form", "refiner_mlp_hidden")
        if any(name in head and head[name] != getattr(model.config, name) for name in fields):
            # e.g. a drafter trained alone (refiner="none") getting its head, or a head of another form or size: keep
            # the drafter, start the head fresh
            return with_fresh_head(model, **{"refiner": model.config.refiner, **head})
        return model
    # A dFlash config may lack the target facts; they are the target's by definition. Trained weights stay float32
    # (releases are bf16, which from_dflash keeps by default; --bf16 autocasts the products).
    text = target.config.get_text_config(decoder=True)
    facts = {key: getattr(text, key, None) for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    return XPressModel.from_dflash(folder, dtype=torch.float32, num_target_layers=text.num_hidden_layers, **facts,
                                   **head)  # fmt: skip


def cached_signals(args: RunArguments, training_args: XPressTrainingArguments, target, data, layer_ids, folder: str):
    """`--signal_cache`: the target's features at `layer_ids` and p^t for `data`, written once to `folder` (by the
    main process first; the others find it finished) and read back; training then runs no target forward."""
    dtype = floating_dtype(args.signal_cache_dtype, "--signal_cache_dtype")  # (the cache refuses those it cannot store)
    with training_args.main_process_first(desc="signal cache"):
        return cache_target_signals(
            target.to(training_args.device), data, layer_ids, folder,
            top_k=args.signal_cache_top_k, dtype=dtype, max_length=training_args.max_seq_length,
            batch_size=training_args.per_device_train_batch_size, progress=not training_args.disable_tqdm,
        )  # fmt: skip


def held_out_cache_folder(folder: str) -> str:
    """Where the held-out rows' signals go, beside the training rows' cache: a cache is the signals of one set of rows."""
    return folder.rstrip("/") + "-held-out"


def train(args: RunArguments, training_args: XPressTrainingArguments, target: PreTrainedModel | None = None):
    """Run one training to its end (resuming from `training_args.resume_from_checkpoint`) and save the final xPress
    folder to `training_args.output_dir`; returns the `XPressTrainer`. `target`: an already loaded target (its dtype
    is the caller's choice), else loaded from `args`."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    set_seed(training_args.seed)
    target = target if target is not None else load_target(args, training_args.seed)
    data, held_out = load_data(args, target, training_args.seed)
    xpress = build_drafter(args, target, data)
    if args.signal_cache:
        layer_ids = xpress.config.target_layer_ids
        data = cached_signals(args, training_args, target, data, layer_ids, args.signal_cache)
        if held_out is not None:
            held_out = cached_signals(
                args, training_args, target, held_out, layer_ids, held_out_cache_folder(args.signal_cache)
            )
    callbacks = []
    if args.early_stopping_patience is not None:
        if held_out is None or not training_args.load_best_model_at_end:
            raise ValueError(
                "--early_stopping_patience needs --eval_held_out N and --load_best_model_at_end "
                "--metric_for_best_model eval_tau_estimate --greater_is_better (with matching eval/save steps)"
            )
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=args.early_stopping_patience))
    trainer = XPressTrainer(
        model=xpress, target=target, args=training_args, train_dataset=data, eval_dataset=held_out, callbacks=callbacks
    )
    if trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(
            f"xPress training: {training_args.world_size} process(es), train_mode={training_args.train_mode}, "
            f"refiner={xpress.config.refiner}, block_size={xpress.config.block_size}, {len(data)} rows, "
            f"{trainable:,} trainable parameters",
            flush=True,
        )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    return trainer
