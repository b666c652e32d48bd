"""Released dFlash drafters as they are, against the field's own code: z-lab's `dflash` package (`DFlashDraftModel`,
installed without its dependencies) and transformers' native dFlash assistant (`MuseGlimmerAssistantModel`).

Every folder here is written by the reference itself (`save_pretrained`, then edited where a test needs what an older
transformers wrote), loaded with `XPressModel.from_dflash`, and compared with the reference's own forward on the same
tiny random target: plain, yarn RoPE (flat `rope_scaling` and `rope_parameters`), sliding-window layers whose window is
shorter than the context, bf16; by path and by Hub id (an offline Hub cache). What xPress writes is read back by the
same references.
"""

import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModel, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, Qwen3Config
from transformers.cache_utils import DFlashCache, DynamicCache

from modeling_xpress import XPressModel
from modeling_xpress.conversion import write_dflash_checkpoint, write_speculators_checkpoint
from modeling_xpress.training.objective import draft_blocks
from tests.builders import randomize, tiny_llama, tiny_qwen3, tiny_xpress
from tests.test_conversion import our_block_logits

try:
    import dflash.model as zlab
except ImportError:
    zlab = None
needs_zlab = pytest.mark.skipif(zlab is None, reason="z-lab's dflash package: `make install` installs it "
                                "(pip install --no-deps dflash==0.1.0)")  # fmt: skip

BLOCK, MASK_ID, TARGET_LAYER_IDS = 6, 7, [1, 3]
GEOMETRY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
# Reference configs. The sliding windows are shorter than the 11-token context: z-lab's and vLLM's sliding layers are
# causal in the block unless `is_causal: false` (then the window must be >= the block).
ZLAB_CASES = {
    "plain": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn": dict(rope_parameters=YARN),
    "sliding": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4, use_sliding_window=True),
    "sliding-non-causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7,
                               use_sliding_window=True, is_causal=False),  # fmt: skip
}


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3()  # 5 layers, hidden 64, vocab 96


def zlab_release(folder, dtype=torch.float32, edit_config=None, **fields):
    """A z-lab release folder written by z-lab's own `DFlashDraftModel.save_pretrained`, and z-lab's model loaded back
    from it (as z-lab's users load a release)."""
    config = Qwen3Config(**GEOMETRY, **fields)
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers, config.block_size = 5, BLOCK
    config.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS}
    randomize(zlab.DFlashDraftModel(config)).to(dtype).save_pretrained(folder)
    if edit_config is not None:
        raw = json.loads((folder / "config.json").read_text())
        edit_config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    return zlab.DFlashDraftModel.from_pretrained(folder).eval()


def prompt(n: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def zlab_block_logits(model, target, prompt_ids, anchor_id, cache=None, start: int = 0):
    """z-lab's drafter logits for the block after `prompt_ids[:, start:]` (the rest already in z-lab's `cache`)."""
    with torch.no_grad():
        hs = target(prompt_ids, output_hidden_states=True).hidden_states
        context = zlab.extract_context_feature(hs, model.target_layer_ids)[:, start:].to(model.dtype)
        ids = torch.tensor([[anchor_id] + [MASK_ID] * (BLOCK - 1)])
        noise = target.get_input_embeddings()(ids).to(model.dtype)
        c = prompt_ids.shape[1]
        hidden = model(position_ids=torch.arange(start, c + BLOCK)[None], noise_embedding=noise, target_hidden=context,
                       past_key_values=cache, use_cache=cache is not None)  # fmt: skip
        return model.compute_logits(hidden[:, 1:].float(), target.get_output_embeddings())[0]


def assert_matches_zlab(xpress, reference, target, atol=1e-4):
    for seed in (0, 1):
        ids, anchor = prompt(seed=seed), 40 + seed
        expected = zlab_block_logits(reference, target, ids, anchor)
        assert expected.std() > 0.1  # a non-degenerate comparison
        torch.testing.assert_close(our_block_logits(xpress, target, ids, anchor).float(), expected, rtol=atol, atol=atol)


# --- reading z-lab's releases -----------------------------------------------------------------------------------------


@needs_zlab
@pytest.mark.parametrize("case", list(ZLAB_CASES))
def test_from_dflash_computes_zlabs_logits(tmp_path, target, case):
    reference = zlab_release(tmp_path / "release", **ZLAB_CASES[case])
    xpress = XPressModel.from_dflash(tmp_path / "release").eval()
    assert_matches_zlab(xpress, reference, target)
    if case != "plain":  # the setting changes the function: matching it is not a no-op
        plain = zlab_release(tmp_path / "plain", **ZLAB_CASES["plain"])
        ids = prompt()
        assert (zlab_block_logits(plain, target, ids, 40) - zlab_block_logits(reference, target, ids, 40)).abs().max() > 0.1


@needs_zlab
def test_flat_rope_scaling_of_transformers_4_is_honoured(tmp_path, target):
    """A 4.x config stores yarn as a flat `rope_scaling` + `rope_theta`; z-lab's code (through transformers) honours it."""

    def to_flat_rope_scaling(raw):
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}

    reference = zlab_release(tmp_path / "release", rope_parameters=dict(YARN), edit_config=to_flat_rope_scaling)
    assert "rope_scaling" in json.loads((tmp_path / "release" / "config.json").read_text())
    xpress = XPressModel.from_dflash(tmp_path / "release").eval()
    assert xpress.config.rope_parameters["rope_type"] == "yarn" and xpress.config.rope_parameters["factor"] == 4.0
    assert_matches_zlab(xpress, reference, target)


@needs_zlab
def test_sliding_window_over_cached_context_matches_zlab(tmp_path, target):
    """Two draft steps through each side's own cache: the window slides over context cached in the first step."""
    reference = zlab_release(tmp_path / "release", **ZLAB_CASES["sliding"])
    xpress = XPressModel.from_dflash(tmp_path / "release").eval()
    ids = prompt(14)
    zlab_cache = zlab._make_cache(reference.config)
    zlab_block_logits(reference, target, ids[:, :6], 40, cache=zlab_cache)
    zlab._crop_to(zlab_cache, 6)
    expected = zlab_block_logits(reference, target, ids, 41, cache=zlab_cache, start=6)
    cache = DynamicCache(config=xpress.config)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in TARGET_LAYER_IDS], -1)
        for start, end, anchor in ((0, 6, 40), (6, 14, 41)):
            out = xpress(xpress.embed_blocks(torch.tensor([[anchor]]), embed), context[:, start:end],
                         position_ids=torch.arange(start, end + BLOCK)[None], cache=cache)  # fmt: skip
            cache.crop(-BLOCK)
        torch.testing.assert_close(xpress.base_logits(out.last_hidden_state, lm_head)[0], expected, rtol=1e-4, atol=1e-4)


@needs_zlab
def test_bf16_release_loads_in_its_dtype_or_the_one_asked_for(tmp_path, target):
    reference = zlab_release(tmp_path / "release", dtype=torch.bfloat16, **ZLAB_CASES["plain"])
    assert reference.dtype == torch.bfloat16
    xpress = XPressModel.from_dflash(tmp_path / "release").eval()  # "auto", as from_pretrained: the folder's dtype
    assert xpress.dtype == torch.bfloat16 and xpress.refiner.readout.weight.dtype == torch.bfloat16
    assert_matches_zlab(xpress, reference, target, atol=2e-2)
    as_fp32 = XPressModel.from_dflash(tmp_path / "release", dtype=torch.float32)
    assert as_fp32.dtype == torch.float32
    for name, tensor in xpress.state_dict().items():
        if not name.startswith("refiner."):
            assert torch.equal(as_fp32.state_dict()[name], tensor.float()), name
    zlab_release(tmp_path / "fp32", **ZLAB_CASES["plain"])
    assert XPressModel.from_dflash(tmp_path / "fp32", dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16
    assert XPressModel.from_dflash(tmp_path / "fp32", dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto', None or a floating torch.dtype"):
        XPressModel.from_dflash(tmp_path / "fp32", dtype=torch.int8)


def populate_hub_cache(cache, repo_id: str, folder) -> None:
    """`folder` as the Hub cache holds a downloaded snapshot of `repo_id` (refs/main → snapshots/<commit>/)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@needs_zlab
def test_hub_repo_id_resolves_through_the_hub_cache(tmp_path, target, monkeypatch):
    reference = zlab_release(tmp_path / "release", **ZLAB_CASES["sliding"])
    populate_hub_cache(tmp_path / "hub", "z-lab/Tiny-DFlash-b6", tmp_path / "release")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    xpress = XPressModel.from_dflash("z-lab/Tiny-DFlash-b6", refiner="markov").eval()
    assert xpress.config.refiner == "markov" and xpress.config.attention_windows == [None, 4]
    assert_matches_zlab(xpress, reference, target)
    # the keywords of `from_pretrained`'s download work too: an explicit cache folder, offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert XPressModel.from_dflash("z-lab/Tiny-DFlash-b6", cache_dir=tmp_path / "hub").config.block_size == BLOCK
    with pytest.raises(OSError, match="Could not get config.json of 'z-lab/Not-Cached'"):
        XPressModel.from_dflash("z-lab/Not-Cached")


# --- reading transformers' native dFlash assistant ------------------------------------------------------------------


def native_forward(native, target, prompt_ids, anchor_id):
    """The native assistant's last hidden states as transformers' `DFlashTokenCandidateGenerator` calls it."""
    with torch.no_grad():
        hs = target(prompt_ids, output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in native.config.target_layer_ids], -1)
        c = prompt_ids.shape[1]
        cache = DFlashCache(config=native.config)
        cache.activate_past_recording()
        cache.set_previous_accepted_tokens(c)
        noise = target.get_input_embeddings()(torch.tensor([[anchor_id] + [native.config.mask_token_id] * (BLOCK - 1)]))
        return native(noise_embeds=noise, context_hidden_states=context, position_ids=torch.arange(c + BLOCK)[None],
                      attention_mask=torch.ones(1, c + BLOCK), cache=cache).last_hidden_state  # fmt: skip


def our_forward(xpress, target, prompt_ids, anchor_id):
    with torch.no_grad():
        hs = target(prompt_ids, output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in xpress.config.target_layer_ids], -1)
        embeds = xpress.embed_blocks(torch.tensor([[anchor_id]]), target.get_input_embeddings())
        return xpress(noise_embeds=embeds, context_hidden_states=context).last_hidden_state


def test_from_dflash_computes_the_native_assistants_hidden_states(tmp_path, target):
    """Its default layers are all sliding (window 2048); here one layer slides with a window shorter than the context."""
    config = MuseGlimmerAssistantConfig(**GEOMETRY, block_size=BLOCK, mask_token_id=MASK_ID, target_layer_ids=TARGET_LAYER_IDS,
                                        layer_types=["full_attention", "sliding_attention"], sliding_window=6,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    randomize(MuseGlimmerAssistantModel(config)).save_pretrained(tmp_path / "native")
    native = AutoModel.from_pretrained(tmp_path / "native").eval()
    xpress = XPressModel.from_dflash(tmp_path / "native", num_target_layers=5).eval()
    assert xpress.config.attention_windows == [None, 7] and not xpress.config.window_causal
    for seed in (0, 1):
        ids = prompt(seed=seed)
        torch.testing.assert_close(our_forward(xpress, target, ids, 40), native_forward(native, target, ids, 40),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    # not a no-op: the native class's default (every layer sliding) computes something else here
    full = MuseGlimmerAssistantConfig(**{**config.to_dict(), "layer_types": ["full_attention"] * 2})
    other = MuseGlimmerAssistantModel(full).eval()
    other.load_state_dict(native.state_dict())
    assert (native_forward(other, target, prompt(), 40) - native_forward(native, target, prompt(), 40)).abs().max() > 0.1


# --- what xPress writes, read back by the references -----------------------------------------------------------------


@needs_zlab
@pytest.mark.parametrize("case", list(ZLAB_CASES))
def test_written_folder_loads_in_zlabs_code_with_the_same_logits(tmp_path, target, case):
    reference = zlab_release(tmp_path / "release", **ZLAB_CASES[case])
    xpress = XPressModel.from_dflash(tmp_path / "release").eval()
    write_dflash_checkpoint(xpress, tmp_path / "written")
    reread = zlab.DFlashDraftModel.from_pretrained(tmp_path / "written").eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(reread.state_dict()[name], tensor), name
    for seed in (0, 1):  # the release's own function, not only the same tensors
        ids = prompt(seed=seed)
        torch.testing.assert_close(zlab_block_logits(reread, target, ids, 40), zlab_block_logits(reference, target, ids, 40))
    assert_matches_zlab(xpress, reread, target)


@pytest.mark.parametrize("windows", [None, [9, None]])
def test_written_transformers_layout_serves_natively(tmp_path, target, windows):
    """layout="transformers": AutoModel gives transformers' own dFlash assistant, which computes the drafter's hidden
    states and runs `speculation_type="dflash"` (today's dFlash layout fails there: AttributeError / IndexError)."""
    xpress = tiny_xpress(target, refiner="none", block_size=BLOCK, mask_token_id=MASK_ID, attention_windows=windows,
                         window_causal=False)  # fmt: skip
    randomize(xpress)
    write_dflash_checkpoint(xpress, tmp_path / "native", layout="transformers")
    native = AutoModel.from_pretrained(tmp_path / "native").eval()
    assert type(native) is MuseGlimmerAssistantModel
    for seed in (0, 1):
        ids = prompt(seed=seed)
        torch.testing.assert_close(native_forward(native, target, ids, 40), our_forward(xpress, target, ids, 40),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    ids = prompt(8)
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=native, speculation_type="dflash")
    assert torch.equal(out, expected)
    assert XPressModel.from_dflash(tmp_path / "native").config.attention_windows == windows


def test_what_the_formats_cannot_say_is_refused(tmp_path, target):
    llama_style = tiny_xpress(tiny_llama(), refiner="none", mask_token_id=0)
    assert llama_style.config.qk_norm is False
    with pytest.raises(ValueError, match=r"no QK-norm \(qk_norm=False.*norms of weight 1 are not the identity"):
        write_dflash_checkpoint(llama_style, tmp_path / "a")
    vocabulary = tiny_xpress(target, refiner="none", mask_token_id=0, draft_vocab_size=32)
    with pytest.raises(ValueError, match="draft vocabulary of 32 tokens.*write_speculators_checkpoint"):
        write_dflash_checkpoint(vocabulary, tmp_path / "b")
    anchored = tiny_xpress(target, refiner="none", mask_token_id=0, attention_windows=[None, 9], window_anchored=True)
    with pytest.raises(ValueError, match="window_anchored=True"):
        write_dflash_checkpoint(anchored, tmp_path / "c")
    causal = tiny_xpress(target, refiner="none", mask_token_id=0, attention_windows=[None, 9])
    with pytest.raises(ValueError, match="write it with layout='dflash'"):
        write_dflash_checkpoint(causal, tmp_path / "d", layout="transformers")
    with pytest.raises(ValueError, match="layout must be one of"):
        write_dflash_checkpoint(causal, tmp_path / "e", layout="zlab")
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_writing_refuses_what_speculators_or_vllm_would_read_differently(tmp_path, target):
    windowed = tiny_xpress(target, refiner="none", mask_token_id=7, attention_windows=[None, 9])
    with pytest.raises(ValueError, match="speculators trains windows that end at the block's anchor"):
        write_speculators_checkpoint(windowed, tmp_path / "a", target)
    last = tiny_xpress(target, refiner="none", mask_token_id=7, target_layer_ids=[1, 4])
    with pytest.raises(ValueError, match=r"include the target's last layer \(4\)"):
        write_speculators_checkpoint(last, tmp_path / "b", target)
    nameless = tiny_xpress(target, refiner="none", mask_token_id=7)
    with pytest.raises(ValueError, match="has no name_or_path"):
        write_speculators_checkpoint(nameless, tmp_path / "c", target)


@needs_zlab
@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw["dflash_config"].update(final_logit_softcapping=30.0), r"dflash_config.final_logit_softcapping=30.0"),
    (lambda raw: raw.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    (lambda raw: raw["dflash_config"].update(use_swa=True), r"dflash_config.use_swa=True"),
    (lambda raw: raw.update(use_sliding_window=False), "sliding_window is unset"),
    (lambda raw: raw["dflash_config"].update(causal=False), "dflash_config.causal=False"),
    (lambda raw: raw.update(is_causal=True), "makes full-attention layers causal"),
])  # fmt: skip
def test_settings_the_drafter_cannot_compute_are_refused(tmp_path, edit, message):
    zlab_release(tmp_path / "release", edit_config=edit, **ZLAB_CASES["sliding"])
    with pytest.raises(ValueError, match=message):
        XPressModel.from_dflash(tmp_path / "release")


def test_attention_windows_are_validated(target):
    with pytest.raises(ValueError, match="one entry per drafter layer"):
        tiny_xpress(target, attention_windows=[4])
    with pytest.raises(ValueError, match=r"integers >= 1, got 0"):
        tiny_xpress(target, attention_windows=[None, 0])
    with pytest.raises(ValueError, match=r"window of 4 < block_size \(8\) with window_causal=False"):
        tiny_xpress(target, attention_windows=[None, 4], window_causal=False)
    with pytest.raises(ValueError, match="window_anchored must be True or False"):
        tiny_xpress(target, window_anchored="yes")


# --- windows everywhere the drafter runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(attention_windows=[None, 5]), dict(attention_windows=[5, 9], window_anchored=True),
                                      dict(attention_windows=[9, None], window_causal=False)])  # fmt: skip
def test_training_forward_applies_the_windows_as_inference_does(target, settings):
    """`draft_blocks` (every block of a batch in one forward) equals one inference forward per block."""
    xpress = randomize(tiny_xpress(target, refiner="none", mask_token_id=MASK_ID, **settings))
    plain = tiny_xpress(target, refiner="none", mask_token_id=MASK_ID)
    plain.load_state_dict(xpress.state_dict())
    ids = prompt(24)
    anchors = torch.tensor([[3, 11, 17]])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in xpress.config.target_layer_ids], -1)
        embed = target.get_input_embeddings()
        batched = draft_blocks(xpress, embed, context, anchors, ids[:, anchors[0]])
        for j, anchor in enumerate(anchors[0].tolist()):
            single = xpress(xpress.embed_blocks(ids[:, anchor : anchor + 1], embed), context[:, :anchor]).last_hidden_state
            torch.testing.assert_close(batched[:, j], single, rtol=1e-5, atol=1e-5)
        assert (draft_blocks(plain, embed, context, anchors, ids[:, anchors[0]]) - batched).abs().max() > 0.05
