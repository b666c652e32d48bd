"""The xPress head is the authors' released function, and their release format loads and saves.

The reference below is written from the published equations of the authors' head (their `refiners/xpress_head.py`
and vLLM `xpress_head.py`, read, not imported), in float64: over the B slots of a block, slot 0 the anchor,

    x_j = W_in [down_h h_j ‖ down_g g ‖ w1[prev_j]]    g = mean_j h_j,  prev_0 = the token before the anchor,
                                                        prev_j = the block token j - 1 (prev_1 = the anchor)
    x   = x + (L ⊙ tril) x                              per channel, tril with its diagonal
    x   = x + down(silu(gate x) · up x)
    δ_j = w2 x_j                                        slot 0's δ is no draft

and their parallel Jacobi decode: seed every draft slot from the drafter's logits, then K passes that re-decode every
draft slot from base + δ(previous pass), greedy or with one Gumbel draw per block shared by the seed and every pass.
A release serving folder (dFlash config + `xpress_*` fields, dFlash tensors + `xpress_head.*`) is built here with
random weights and loaded as a user would.
"""

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.conversion import convert_release_pickle, write_dflash_checkpoint, write_xpress_release
from modeling_xpress.refinement import gumbel_noise
from tests.builders import tiny_qwen3

VOCAB, BLOCK, RANK, MLP = 96, 8, 12, 20
LAYER_IDS = [1, 3]


# --- the reference, from the published equations --------------------------------------------------------------------


def reference_bias(w: dict[str, torch.Tensor], hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """δ over all B slots (b, B, V) of the authors' head: hidden (b, B, H) slot 0 the anchor's, prev (b, B)."""
    g = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
    x = torch.cat([hidden @ w["down_h.weight"].T, g @ w["down_g.weight"].T, w["w1.weight"][prev]], dim=-1)
    x = x @ w["in_proj.weight"].T  # (b, B, r)
    lower = w["mix.L"] * torch.tril(torch.ones(BLOCK, BLOCK, dtype=x.dtype))  # (r, B, B)
    mixed = torch.einsum("ckj,bjc->bkc", lower, x)
    x = x + mixed
    gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return x @ w["w2.weight"].T


def reference_jacobi(w, hidden, base, anchor, before, passes: int, noise=None, temperature: float = 1.0):
    """The authors' par-K decode. base (b, B - 1, V) of the draft slots; returns the draft tokens (b, B - 1)."""

    def pick(logits):
        return logits.argmax(-1) if noise is None else (logits / temperature + noise).argmax(-1)

    b = base.shape[0]
    block = torch.empty(b, BLOCK, dtype=torch.long)
    block[:, 0] = anchor
    block[:, 1:] = pick(base)
    for _ in range(passes):
        prev = block.roll(shifts=1, dims=1)
        prev[:, 0] = before
        block[:, 1:] = pick(base + reference_bias(w, hidden, prev)[:, 1:])
    return block[:, 1:]


# --- a release serving folder with random weights ------------------------------------------------------------------


def release_weights(hidden_size: int, seed: int = 0, std: float = 0.4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "w1.weight": (VOCAB, RANK), "down_h.weight": (RANK, hidden_size), "down_g.weight": (RANK, hidden_size),
        "in_proj.weight": (RANK, 3 * RANK), "mix.L": (RANK, BLOCK, BLOCK), "mlp.gate_proj.weight": (MLP, RANK),
        "mlp.up_proj.weight": (MLP, RANK), "mlp.down_proj.weight": (RANK, MLP), "w2.weight": (VOCAB, RANK),
    }  # fmt: skip
    return {name: torch.randn(*shape, generator=g) * std for name, shape in shapes.items()}


def release_folder(tmp_path: Path, target, head: dict[str, torch.Tensor], dtype=torch.float32, **config) -> Path:
    """A serving folder as the authors' converter writes one: a dFlash folder, its config extended with the xpress
    fields, its safetensors with the head's tensors under `xpress_head.`."""
    drafter = XPressModel(XPressConfig.from_target_config(
        target.config, num_hidden_layers=2, intermediate_size=96, block_size=BLOCK, mask_token_id=5,
        target_layer_ids=LAYER_IDS, refiner="none",
    )).to(dtype)  # fmt: skip
    folder = write_dflash_checkpoint(drafter, tmp_path / "release")
    raw = json.loads((folder / "config.json").read_text())
    raw.update({"architectures": ["Qwen3XPressModel"], "xpress_rank": RANK, "xpress_mlp_hidden": MLP,
                "xpress_block_size": BLOCK, "xpress_num_passes": 6, "sample_from_anchor": False, **config})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw))
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    state.update({"xpress_head." + k: v.to(dtype).contiguous() for k, v in head.items()})
    save_file(state, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab_size=VOCAB)


@pytest.fixture
def loaded(tmp_path, target):
    head = release_weights(target.config.hidden_size)
    model = XPressModel.from_pretrained(release_folder(tmp_path, target, head)).double().eval()
    return model, {k: v.double() for k, v in head.items()}


def block_inputs(hidden_size: int, b: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, BLOCK, hidden_size, generator=g, dtype=torch.float64)
    base = torch.randn(b, BLOCK - 1, VOCAB, generator=g, dtype=torch.float64) * 3
    last = torch.randint(0, VOCAB, (b, 2), generator=g)
    return hidden, base, last


# --- the function ---------------------------------------------------------------------------------------------------


def test_release_folder_loads_the_authors_head(loaded):
    model, _ = loaded
    config = model.config
    assert (config.refiner, config.refiner_form, config.refiner_rank, config.refiner_mlp_width) == (
        "xpress", "release", RANK, MLP,
    )  # fmt: skip
    assert config.jacobi_max_iters == 6  # xpress_num_passes


def test_bias_equals_the_published_function(loaded, target):
    model, w = loaded
    hidden, _, last = block_inputs(target.config.hidden_size)
    prev = torch.cat([last, torch.randint(0, VOCAB, (hidden.shape[0], BLOCK - 2))], dim=1)
    expected = reference_bias(w, hidden, prev)[:, 1:]
    assert expected.abs().mean() > 1.0  # a strong, non-trivial head
    got = model.refiner(hidden, prev)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())
    folded = model.refiner.delta_folded(model.refiner.prepare(hidden), prev)  # the inference form, folded operators
    torch.testing.assert_close(folded, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())


@pytest.mark.parametrize("early_exit", [True, False])
@pytest.mark.parametrize("passes", [1, 3, 6, 7])
def test_greedy_jacobi_drafts_equal_the_published_decode(loaded, target, passes, early_exit):
    model, w = loaded
    hidden, base, last = block_inputs(target.config.hidden_size)
    expected = reference_jacobi(w, hidden, base, last[:, 1], last[:, 0], passes)
    got = model.refine(hidden, base, last, max_iters=passes, early_exit=early_exit)
    assert torch.equal(got.tokens, expected)
    if passes == 1:
        assert not torch.equal(got.tokens, base.argmax(-1))  # the head changed the drafts


@pytest.mark.parametrize("passes", [1, 3, 6])
def test_sampled_jacobi_drafts_equal_the_published_decode_with_shared_noise(loaded, target, passes):
    model, w = loaded
    hidden, base, last = block_inputs(target.config.hidden_size, seed=3)
    noise = gumbel_noise(base.shape, generator=torch.Generator().manual_seed(7)).double()
    temperature = 0.8
    expected = reference_jacobi(w, hidden, base, last[:, 1], last[:, 0], passes, noise, temperature)
    got = model.refine(hidden, base, last, max_iters=passes, noise=noise, logits_transform=lambda x: x / temperature)
    assert torch.equal(got.tokens, expected)


def test_the_compiled_loops_jacobi_form_equals_the_published_decode(loaded, target):
    from modeling_xpress.compiled import jacobi_fixed_iterations

    model, w = loaded
    hidden, base, last = block_inputs(target.config.hidden_size, seed=4)
    folded = model.refiner.folded()
    got = jacobi_fixed_iterations(model.refiner, folded, hidden, base, last, iterations=6)
    assert torch.equal(got.tokens, reference_jacobi(w, hidden, base, last[:, 1], last[:, 0], 6))


# --- end to end on a tiny target -------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["spec_generate", "compiled", "generate", "tree"])
def test_a_release_folder_decodes_the_targets_own_greedy_output(tmp_path, target, route):
    head = release_weights(target.config.hidden_size, seed=2)
    xpress = XPressModel.from_pretrained(release_folder(tmp_path, target, head)).eval()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    if route == "generate":
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                              assistant_model=xpress)  # fmt: skip
    else:
        kwargs = {"compile": True} if route == "compiled" else {"tree_nodes": 6} if route == "tree" else {}
        out = xpress.spec_generate(target, ids, max_new_tokens=30, **kwargs).sequences
    assert torch.equal(out, plain)
    assert xpress.generation_stats.mean_tau >= 1.0


# --- the format in and out ------------------------------------------------------------------------------------------


def test_release_folder_loads_by_hub_id_from_the_cache(tmp_path, target):
    """A Hub repo id resolves through huggingface_hub like any from_pretrained: here from a populated cache, offline."""
    head = release_weights(target.config.hidden_size)
    folder = release_folder(tmp_path, target, head, dtype=torch.bfloat16)
    cache = tmp_path / "hub"
    snapshot = cache / "models--UIUC-SSAIL--tiny-XPress-b8" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (cache / "models--UIUC-SSAIL--tiny-XPress-b8" / "refs").mkdir()
    (cache / "models--UIUC-SSAIL--tiny-XPress-b8" / "refs" / "main").write_text("a" * 40)
    model = XPressModel.from_pretrained("UIUC-SSAIL/tiny-XPress-b8", cache_dir=str(cache), local_files_only=True)
    assert model.dtype == torch.bfloat16  # the stored dtype
    by_path = XPressModel.from_pretrained(folder, dtype=torch.float32)
    assert by_path.dtype == torch.float32
    for name, tensor in by_path.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].float()), name


def test_written_release_folder_reads_back_to_the_same_function(tmp_path, loaded, target):
    model, _ = loaded
    model = model.float()
    folder = write_xpress_release(model, tmp_path / "out", num_passes=5)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3XPressModel"] and raw["xpress_num_passes"] == 5
    assert (raw["xpress_rank"], raw["xpress_mlp_hidden"], raw["xpress_block_size"]) == (RANK, MLP, BLOCK)
    back = XPressModel.from_pretrained(folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert back.config.jacobi_max_iters == 5


def test_release_format_errors_say_what_is_wrong(tmp_path, target):
    hidden_size = target.config.hidden_size
    head = release_weights(hidden_size)
    extra = dict(head, **{"res_gate": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unknown \['xpress_head.res_gate'\]"):
        XPressModel.from_pretrained(release_folder(tmp_path / "a", target, extra))
    fewer = {k: v for k, v in head.items() if k != "mix.L"}
    with pytest.raises(ValueError, match=r"missing \['xpress_head.mix.L'\]"):
        XPressModel.from_pretrained(release_folder(tmp_path / "b", target, fewer))
    with pytest.raises(ValueError, match="sample_from_anchor"):
        XPressModel.from_pretrained(release_folder(tmp_path / "c", target, head, sample_from_anchor=True))
    # What the format cannot hold is refused, not written as another function.
    paper = XPressModel(XPressConfig.from_target_config(target.config, num_hidden_layers=1, block_size=BLOCK,
                                                        mask_token_id=5, refiner_form="paper", refiner_rank=4))  # fmt: skip
    with pytest.raises(ValueError, match="refiner_form='paper'"):
        write_xpress_release(paper, tmp_path / "d")
    vocabulary = XPressModel(XPressConfig.from_target_config(target.config, num_hidden_layers=1, block_size=BLOCK,
                                                             mask_token_id=5, refiner_rank=4, draft_vocab_size=32))  # fmt: skip
    with pytest.raises(ValueError, match="draft vocabulary of 32"):
        write_xpress_release(vocabulary, tmp_path / "e")


def test_a_paper_form_checkpoint_never_loads_as_the_release_head(tmp_path, target):
    """Checkpoints saved before `refiner_form` existed hold the paper form's head and no such field: loading one
    without saying so is an error that names the fix, and saying so loads it exactly."""
    paper = XPressModel(XPressConfig.from_target_config(target.config, num_hidden_layers=1, block_size=BLOCK,
                                                        refiner_form="paper", refiner_rank=8))  # fmt: skip
    with torch.no_grad():
        for p in paper.refiner.parameters():
            p.normal_()
    paper.save_pretrained(tmp_path / "old")
    raw = json.loads((tmp_path / "old" / "config.json").read_text())
    del raw["refiner_form"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match='"refiner_form": "paper"'):
        XPressModel.from_pretrained(tmp_path / "old")
    back = XPressModel.from_pretrained(tmp_path / "old", refiner_form="paper")
    for name, tensor in paper.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_the_training_pickle_converts_only_when_trusted(tmp_path, target):
    """The authors' `refiner_cotrain.pt`: a pickle with an argparse Namespace in it, so `weights_only` refuses it;
    the converter says that loading it runs code, and converts it when told to trust it."""
    head = release_weights(target.config.hidden_size, seed=5)
    folder = release_folder(tmp_path, target, head)
    expected = XPressModel.from_pretrained(folder)
    drafter = {k: v for k, v in expected.state_dict().items() if not k.startswith("refiner.")}
    path = tmp_path / "refiner_cotrain.pt"
    torch.save({"draft_state_dict": drafter, "refiner_state_dict": head, "args": Namespace(markov_rank=RANK),
                "step": 10}, path)  # fmt: skip
    with pytest.raises(ValueError, match="runs whatever code"):
        convert_release_pickle(XPressModel, path, folder)
    model = convert_release_pickle(XPressModel, path, folder, trust_pickle=True)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_the_converter_script_runs_as_documented(tmp_path, target):
    """examples/convert_xpress_release.py: the pickle refused without --trust-pickle, converted with it; the result
    written back in the release format loads as the same model."""
    import subprocess
    import sys

    head = release_weights(target.config.hidden_size, seed=6)
    folder = release_folder(tmp_path, target, head)
    expected = XPressModel.from_pretrained(folder)
    drafter = {k: v for k, v in expected.state_dict().items() if not k.startswith("refiner.")}
    torch.save({"draft_state_dict": drafter, "refiner_state_dict": head, "args": Namespace(markov_rank=RANK)},
               tmp_path / "refiner_cotrain.pt")  # fmt: skip
    script = [sys.executable, "examples/convert_xpress_release.py"]
    command = [*script, "pickle", str(tmp_path / "refiner_cotrain.pt"), "--base-config", str(folder / "config.json"),
               "--out", str(tmp_path / "converted")]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode != 0 and "--trust-pickle" in refused.stderr
    subprocess.run([*command, "--trust-pickle"], check=True, capture_output=True)
    subprocess.run([*script, "release", str(tmp_path / "converted"), "--out", str(tmp_path / "served")], check=True,
                   capture_output=True)  # fmt: skip
    for path in (tmp_path / "converted", tmp_path / "served"):
        model = XPressModel.from_pretrained(path)
        for name, tensor in expected.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), (path, name)
