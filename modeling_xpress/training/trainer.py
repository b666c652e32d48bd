"""`XPressTrainer`: transformers' `Trainer` for an xPress drafter + head against a frozen target (paper §4.3).

It holds the frozen target, applies the training mode (`prepare_for_training`: head only, everything, or LoRA on the
drafter), logs every term of the objective (`objective.XPressObjective`), and writes each checkpoint as a loadable
xPress Hub folder (LoRA merged, target never saved) that `resume_from_checkpoint` reads. `with_fresh_head` starts the
second stage of training from scratch: a trained drafter with a new head.

This file does not travel with checkpoints (it imports peft and the Trainer); only the package uses it.
"""

import copy
import hashlib
import json
import math
import os
import time

import torch
import torch.nn as nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.utils import logging

from ..modeling_xpress import XPressModel
from .arguments import XPressTrainingArguments
from .collator import XPressDataCollator
from .loss import anchor_weight
from .objective import XPressObjective
from .signal_cache import SignalCacheCollator, check_signal_cache, signal_cache_settings
from .snapshot import SNAPSHOT_NOTE

logger = logging.get_logger(__name__)


# Sub-folder of a LoRA checkpoint holding the unmerged adapter: the merged weights alone cannot be resumed from.
LORA_CHECKPOINT_DIR = "lora_adapter"
_BASE_FINGERPRINT_FILE = "xpress_base_fingerprint.json"


def prepare_for_training(xpress: XPressModel, args: XPressTrainingArguments) -> nn.Module:
    """Apply `args.train_mode`: freeze the drafter, unfreeze everything, or wrap it with LoRA (peft).

    The head is always trained in full; with LoRA it is declared `modules_to_save`, so the adapter checkpoint carries
    it and `merge_and_unload` puts the trained copy back in place.
    """
    if args.train_mode == "refiner":
        if not xpress.refiner.corrects:
            raise ValueError(
                "train_mode='refiner' trains only the head, but this model has refiner='none'. Use train_mode='full' "
                "(or 'lora') to train the drafter alone."
            )
        xpress.requires_grad_(False)
        xpress.refiner.requires_grad_(True)
        return xpress
    if args.train_mode == "full":
        return xpress.requires_grad_(True)
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(args.lora_target_modules),
        modules_to_save=["refiner"] if xpress.refiner.corrects else None,
    )
    return get_peft_model(xpress, lora)


def with_fresh_head(model: XPressModel, refiner: str, refiner_rank: int | None = None, **head) -> XPressModel:
    """A new `XPressModel` with `model`'s drafter weights and a fresh `refiner` head (δ = 0 until trained).

    The second stage of training from scratch: a drafter trained alone (`refiner="none"`) gets an xPress or Markov
    head; or a head is swapped for another on the same drafter. `head`: more of the head's config fields
    (`refiner_form`, `refiner_mlp_hidden`).
    """
    config = copy.deepcopy(model.config)
    config.refiner = refiner
    if refiner_rank is not None:
        config.refiner_rank = refiner_rank
    unknown = [k for k in head if k not in ("refiner_form", "refiner_mlp_hidden")]
    if unknown:
        raise ValueError(f"with_fresh_head sets the head's fields refiner_form and refiner_mlp_hidden, not {unknown}")
    for name, value in head.items():
        setattr(config, name, value)
    config.validate_xpress()
    fresh = XPressModel(config).to(model.device, model.dtype)
    drafter = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith("refiner.")}
    missing, unexpected = fresh.load_state_dict(drafter, strict=False)
    stray = [name for name in missing if not name.startswith("refiner.")] + list(unexpected)
    if stray:
        raise ValueError(f"drafter weights do not fit the new model: {stray}")
    return fresh


class _AnchorEpochCallback(TrainerCallback):
    """Tells the collator which epoch starts, so a row seen again gets new anchors. The epoch comes from the Trainer's
    state, which a resumed run restores, so the resumed run continues the anchors of the interrupted one."""

    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        # `state.epoch` is `epoch + fraction done`: an exact integer at an epoch's start, mid-way after a resume.
        self.collator.set_epoch(math.floor(state.epoch))


class _TrainingClock(TrainerCallback):
    """Training wall time summed over every process run of a training (first run and each resume): the seconds of
    the interrupted runs come back with the restored state's last logged `train_seconds`."""

    def __init__(self):
        self.before = 0.0
        self.start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        logged = [entry["train_seconds"] for entry in state.log_history if "train_seconds" in entry]
        self.before = logged[-1] if logged else 0.0
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.start


def _frozen_fingerprint(model: nn.Module) -> str:
    """sha256 of every frozen tensor of the LoRA-wrapped drafter: the base an adapter checkpoint is only valid on."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if not p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class XPressTrainer(Trainer):
    """`Trainer` for an xPress drafter + head against a frozen target, with the paper's objective.

    Example:

    ```python
    >>> args = XPressTrainingArguments(output_dir="out", max_steps=1000, per_device_train_batch_size=8, bf16=True)
    >>> trainer = XPressTrainer(model=xpress, target=target, args=args, train_dataset=responses)
    >>> trainer.train()  # checkpoints in out/checkpoint-*/ load with XPressModel.from_pretrained
    ```

    `model` is the `XPressModel` to train (fresh, converted from dFlash, or a previous xPress checkpoint); `target`
    the model it drafts for. The target is frozen, put in eval mode, moved to the training device, and never saved.
    `train_dataset` rows hold `input_ids` and `loss_mask` (1 on response tokens), e.g. from
    `regeneration.regenerate_responses`, or a signal cache of them (`signal_cache.load_signal_cache`: the target
    then runs no forward, only its embedding table and lm_head are used). Every checkpoint (and `save_model`) is a
    self-contained xPress Hub folder — LoRA merged — plus the Trainer's state, so `train(resume_from_checkpoint=...)`
    continues the run.
    `self.model` is the `XPressObjective` (the module DDP wraps); `self.xpress` the drafter being trained.
    """

    def __init__(
        self,
        model: XPressModel,
        target: PreTrainedModel,
        args: XPressTrainingArguments,
        train_dataset=None,
        eval_dataset=None,
        data_collator=None,
        **kwargs,
    ):
        if not isinstance(args, XPressTrainingArguments):
            raise ValueError(f"args must be XPressTrainingArguments (it carries the objective), got {type(args).__name__}")
        if not (isinstance(model, PreTrainedModel) and getattr(model.config, "model_type", None) == "xpress"):
            raise ValueError(f"model must be an XPressModel, got {type(model).__name__}")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init is not supported by XPressTrainer; pass the XPressModel as model=")
        model.config.check_target(target.config)
        target.requires_grad_(False).eval()
        # Rows of a signal cache (`signal_cache.load_signal_cache`) carry the target's features and p^t, so the target
        # runs no forward: they must hold this drafter's layers of this target.
        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        caches = [signal_cache_settings(d) for d in (train_dataset, *evals) if d is not None]
        for settings in filter(None, caches):
            check_signal_cache(settings, model.config, target)
        self.target = target
        self.xpress = prepare_for_training(model, args)
        self.is_lora = args.train_mode == "lora"
        self._base_fingerprint = _frozen_fingerprint(self.xpress) if self.is_lora else None
        objective = XPressObjective(
            self.xpress,
            target,
            gamma=args.resolved_gamma(model.config.block_size),
            ce_weight=args.ce_weight,
            l1_weight=args.l1_weight,
            consistency_weight=args.consistency_weight,
            consistency_rounds=args.consistency_rounds,
        )
        if data_collator is None:
            data_collator = (SignalCacheCollator if any(caches) else XPressDataCollator)(
                block_size=model.config.block_size,
                anchors_per_sequence=args.anchors_per_sequence,
                pad_token_id=model.config.pad_token_id or 0,
                max_length=args.max_seq_length,
                # The same for every process: anchors depend on the row, not on which process collates it.
                seed=args.seed,
            )
        if hasattr(data_collator, "set_epoch"):
            if args.dataloader_persistent_workers and args.dataloader_num_workers > 0:
                raise ValueError(
                    "dataloader_persistent_workers=True keeps the collator each worker copied at the first epoch, so "
                    "set_epoch never reaches it and every epoch would train the same anchors of a row. Set "
                    "dataloader_persistent_workers=False (workers then restart, with the new epoch, every epoch)."
                )
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), _AnchorEpochCallback(data_collator)]
        self._clock = _TrainingClock()
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self._clock]
        super().__init__(
            model=objective,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            **kwargs,
        )
        # The objective returns a per-batch mean: the Trainer must divide it for gradient accumulation itself.
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        if getattr(target, "hf_device_map", None) is None:  # a target dispatched over devices stays where it is
            self.target.to(self.args.device)
        self._metric_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}

    # --- optimizer ---------------------------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        """transformers' optimizer, its groups split into the head's parameters (at `learning_rate`) and the drafter's
        (at `learning_rate × drafter_lr_scale`) when the scale is not 1; the schedule then scales both alike."""
        optimizer = super().create_optimizer(model)
        scale = self.args.drafter_lr_scale
        if scale == 1.0:
            return optimizer
        head = {id(p) for name, p in self.model.named_parameters() if "refiner." in name}
        groups = []
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for is_head in (True, False):
                params = [p for p in group["params"] if (id(p) in head) == is_head]
                if params:
                    lr = settings["lr"] * (1.0 if is_head else scale)
                    groups.append({**settings, "params": params, "lr": lr, "initial_lr": lr})
        optimizer.param_groups.clear()  # before the first step: no state yet
        for group in groups:
            optimizer.add_param_group(group)
        return optimizer

    # --- loss and logs -----------------------------------------------------------------------------------------------

    def current_anchor_weight(self) -> float:
        """λ for the step being trained: annealed linearly from `anchor_weight_start` to `anchor_weight_floor`."""
        return anchor_weight(
            self.state.global_step, self.state.max_steps, self.args.anchor_weight_start, self.args.anchor_weight_floor
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, anchor_weight=self.current_anchor_weight())
        sums = self._metric_sums["train" if model.training else "eval"]
        for name, value in outputs.metrics.items():
            sums[name] = sums[name] + value if name in sums else value.detach().clone()
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation computes the objective (and its metrics); there are no logits worth gathering."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _flush_metrics(self, split: str) -> dict[str, float]:
        """Averages of the metrics recorded since the last log, over steps and processes; resets them."""
        sums = self._metric_sums[split]
        names = list(sums)
        stacked = torch.stack([sums[name] for name in names]).to(self.args.device)  # (K, 2): sum, count
        if self.accelerator.num_processes > 1:  # every process logs at the same step, so this collective is safe
            stacked = self.accelerator.reduce(stacked, reduction="sum")
        sums.clear()
        prefix = "eval_" if split == "eval" else ""
        return {prefix + name: s / c for name, (s, c) in zip(names, stacked.tolist()) if c > 0}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the objective's terms, per-position acceptance and the training's wall time so far (`train_seconds`,
        summed over resumed runs) to the Trainer's own training / evaluation logs."""
        split = "train" if "loss" in logs else "eval" if "eval_loss" in logs else None
        if split is not None and self._metric_sums[split]:
            logs.update(self._flush_metrics(split))
        if split is not None:  # wall time of the whole training so far, resumes included (`_TrainingClock`)
            logs["train_seconds"] = round(self._clock.seconds(), 1)
        super().log(logs, start_time)

    # --- checkpoints -------------------------------------------------------------------------------------------------

    def export_model(self) -> XPressModel:
        """The trained model as a plain `XPressModel`: with LoRA, a merged copy (training continues on the adapter)."""
        if not self.is_lora:
            return self.xpress
        return copy.deepcopy(self.xpress).merge_and_unload()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write a loadable xPress Hub folder (config, weights, code, card; LoRA merged; never the target). A LoRA run
        also keeps its unmerged adapter in `lora_adapter/`, which `resume_from_checkpoint` needs."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        logger.info(f"Saving xPress checkpoint to {output_dir}")
        self.export_model().save_pretrained(output_dir)
        if self.is_lora:
            adapter_dir = os.path.join(output_dir, LORA_CHECKPOINT_DIR)
            self.xpress.save_pretrained(adapter_dir)
            with open(os.path.join(adapter_dir, _BASE_FINGERPRINT_FILE), "w") as f:
                json.dump({"sha256": self._base_fingerprint}, f)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Restore the trained weights from a checkpoint `_save` wrote (the Trainer restores optimizer, scheduler,
        RNG and step itself)."""
        if self.is_lora:
            from peft.utils import load_peft_weights, set_peft_model_state_dict

            adapter_dir = os.path.join(resume_from_checkpoint, LORA_CHECKPOINT_DIR)
            if not os.path.isdir(adapter_dir):
                raise ValueError(
                    f"{resume_from_checkpoint} has no {LORA_CHECKPOINT_DIR}/: it was not written by a train_mode='lora' "
                    "run, so there is no adapter to resume. Start a new run with --init_from pointing at it instead."
                )
            with open(os.path.join(adapter_dir, _BASE_FINGERPRINT_FILE)) as f:
                saved = json.load(f)["sha256"]
            if saved != self._base_fingerprint:
                raise ValueError(
                    f"The LoRA adapter in {adapter_dir} was trained on a different base drafter than the one this "
                    "trainer was built with. Resume with the same initial model (e.g. the same --init_from), not with "
                    "the merged checkpoint."
                )
            set_peft_model_state_dict(self.xpress, load_peft_weights(adapter_dir, device="cpu"))
            return
        saved = XPressModel.from_pretrained(resume_from_checkpoint)
        self.xpress.load_state_dict(saved.state_dict())

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A snapshot (`snapshot_checkpoint`: a checkpoint without its optimizer state) resumes with the learning-rate
        schedule where it was and a fresh optimizer; the Trainer itself would drop the schedule too and restart it."""
        snapshot = (
            checkpoint is not None
            and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME))
            and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME))
            and os.path.isfile(os.path.join(checkpoint, SNAPSHOT_NOTE))
        )
        if not snapshot:
            return super()._load_optimizer_and_scheduler(checkpoint)
        logger.warning(
            f"{checkpoint} is a snapshot without optimizer state: the learning-rate schedule continues at step "
            f"{self.state.global_step}, the optimizer's moments start again from zero."
        )
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
