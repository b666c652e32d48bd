"""The xpress_vllm plugin against the real vLLM, in its own virtualenv (.venv-vllm, `make vllm`).

Every test drives vLLM in a subprocess of .venv-vllm's Python: the engines (examples/vllm_benchmark.py's `engine`
mode, enforce_eager for a quick start), the OpenAI-compatible server of `make serve`, and the errors an xPress
checkpoint gives where vLLM cannot honour it. `make test` sets XPRESS_VLLM_TESTS=required, so there a missing
.venv-vllm fails instead of skipping.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import tiny_gemma3, tiny_llama, tiny_tokenizer, tiny_xpress

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CHECKPOINT = REPO / "checkpoints" / "xpress-smollm2-135m-instruct"
BENCHMARK = REPO / "examples" / "vllm_benchmark.py"
REQUIRED = os.environ.get("XPRESS_VLLM_TESTS") == "required"

pytestmark = pytest.mark.slow


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a .venv-vllm subprocess (and of the vLLM processes it starts): this checkout's packages ahead
    of the editable install .venv-vllm was built with, which may be another checkout's (a git worktree's venv is often
    a link to the main one), so that the tests always run the code beside them."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        message = f"{VLLM_PYTHON} does not exist: build it with `make vllm`"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def target_dir() -> Path:
    from modeling_xpress.bench.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def prompts_file(target_dir, tmp_path_factory) -> Path:
    """Seven held-out task prompts, chat-templated (46..199 tokens), and one bare 3-token prompt: mixed lengths."""
    from transformers import AutoTokenizer

    from modeling_xpress.training.prompts import TASK_KINDS
    from modeling_xpress.training.regeneration import held_out_prompts

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
           for text in held_out_prompts(7, kinds=TASK_KINDS)]  # fmt: skip
    ids.append(tokenizer("def fib(n):")["input_ids"])
    path = tmp_path_factory.mktemp("vllm") / "prompts.json"
    path.write_text(json.dumps({"prompt_token_ids": ids}))
    return path


def run_engine(vllm_python, method, prompts, out, target, *extra, checkpoint=CHECKPOINT, check=True):
    command = [str(vllm_python), str(BENCHMARK), "engine", "--method", method, "--out", str(out), "--prompts", str(prompts),
               "--checkpoint", str(checkpoint), "--target", str(target), "--eager", "--memory", "0.2", *extra]  # fmt: skip
    env = vllm_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    # vLLM logs (and reports a worker's exception) on stdout: keep both streams in one.
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env,
                          cwd=REPO)  # fmt: skip
    if check:
        assert done.returncode == 0, done.stdout[-4000:]
        return json.loads(Path(out).read_text())
    return done


def test_plugin_imports_under_vllms_transformers(vllm_python):
    """vLLM pins an older transformers; the plugin, the runtime it uses and the entry point load under it."""
    code = (
        "import importlib.metadata as m, transformers, vllm, xpress_vllm, modeling_xpress\n"
        "from xpress_vllm.model import XPressDFlashForCausalLM\n"
        "names = [e.name for e in m.entry_points(group='vllm.general_plugins')]\n"
        "assert 'xpress' in names, names\n"
        "print(transformers.__version__, vllm.__version__)"
    )
    done = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, env=vllm_env())
    assert done.returncode == 0, done.stderr[-3000:]
    transformers_version, vllm_version = done.stdout.split()
    assert not transformers_version.startswith("5.24")  # really the other release
    sys.path.insert(0, str(REPO))
    from xpress_vllm import vllm_version_supported

    assert vllm_version_supported(vllm_version)


def test_steps_without_drafts_skip_vllms_recovered_token_draw(vllm_python):
    """On CPU `register` wraps vLLM's own `sample_recovered_tokens` (xpress_vllm/fixes.py): with no draft token in a
    step the wrapper returns what vLLM's function returns (an empty tensor of the drafts' dtype, checked against its
    source) without drawing its noise over the vocabulary (the global RNG is left as it was)."""
    code = """
import inspect, types, torch, xpress_vllm
from vllm.v1.sample import rejection_sampler as rs
own = rs.sample_recovered_tokens
xpress_vllm.register()
assert rs.sample_recovered_tokens.skips_steps_without_drafts and rs.sample_recovered_tokens.__wrapped__ is own
args = (0, [0, 0], torch.zeros(2, dtype=torch.int32), torch.empty(0, dtype=torch.int32), None,
        torch.empty(0, 49152), types.SimpleNamespace(generators={}), torch.device("cpu"), False)
state = torch.get_rng_state()
skipped = rs.sample_recovered_tokens(*args)
assert torch.equal(torch.get_rng_state(), state)
assert skipped.shape == (0,) and skipped.dtype == torch.int32
# vLLM's own function (its CPU kernel only runs inside an engine): noise first, then this empty-like result
source = inspect.getsource(own)
assert "q.exponential_()" in source and "recovered_token_ids = torch.empty_like(draft_token_ids)" in source
print("ok")
"""
    done = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=vllm_env())  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_steps_without_drafts_sample_as_vllms_rejection_sampler_would(vllm_python):
    """On CPU `register` wraps vLLM's `RejectionSampler.forward` (xpress_vllm/fixes.py). Checked against vLLM's own
    code: for a step without drafts its output is the bonus tokens of `self.sampler(..., predict_bonus_token=True)`
    on the rows `bonus_logits_indices` picks, and with no drafts those are all rows, in order."""
    code = """
import inspect, types, numpy as np, torch, xpress_vllm
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
own = rs.RejectionSampler.forward
xpress_vllm.register()
assert rs.RejectionSampler.forward.samples_plainly_without_drafts and rs.RejectionSampler.forward.__wrapped__ is own
source = inspect.getsource(own)
assert "bonus_logits = logits[bonus_logits_indices]" in source and "predict_bonus_token=True" in source
# The model runner's metadata for three requests (5, 1 and 34 tokens scheduled) with no drafts
runner = types.SimpleNamespace(arange_np=np.arange(256), _arange_scratch=np.zeros(256, np.int32),
                               device=torch.device("cpu"), input_ids=types.SimpleNamespace(gpu=torch.arange(256)))
runner._get_cumsum_and_arange = lambda *a, **k: GPUModelRunner._get_cumsum_and_arange(runner, *a, **k)
metadata = GPUModelRunner._calc_spec_decode_metadata(runner, np.zeros(3, np.int32), np.array([5, 6, 40], np.int32))
assert metadata.max_spec_len == 0 and metadata.logits_indices.tolist() == [4, 5, 39]
assert metadata.bonus_logits_indices.tolist() == [0, 1, 2]
print("ok")
"""
    done = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=vllm_env())  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_greedy_output_is_vllm_plains_at_batch_1_and_8(vllm_python, prompts_file, target_dir, tmp_path):
    """SmolLM2 fp32, greedy: vLLM with the xPress drafter emits exactly vLLM plain's tokens, one request at a time
    and eight at once (mixed prompt lengths); the head ran inside vLLM's dFlash proposer and paid off (τ).

    With vLLM's dynamic schedule (`xpress-dyn`: drafts only while at most 2 requests run), the eight-request batch
    starts with steps that draft nothing, where the plugin only keeps the context writes (the prompts' included); six
    requests stop after 24 tokens, and the first step that drafts writes the last two's context into the drafter's
    cache and drafts from it (a lost or misplaced write would show as τ near 1)."""
    settings = ("--batches", "1", "8", "--temperatures", "0", "--k", "3", "--max-tokens", *["24"] * 6, "72", "72")
    plain = run_engine(vllm_python, "plain", prompts_file, tmp_path / "plain.json", target_dir, *settings)
    xpress = run_engine(vllm_python, "xpress", prompts_file, tmp_path / "xpress.json", target_dir, *settings)
    dynamic = run_engine(vllm_python, "xpress-dyn", prompts_file, tmp_path / "dyn.json", target_dir, *settings)
    assert xpress["drafter"]["proposer"] == "XPressDFlashProposer"
    assert xpress["drafter"]["model"] == "XPressDFlashForCausalLM"
    assert xpress["drafter"]["head"] == "XPressRefiner" and xpress["drafter"]["head_sum"] > 0  # loaded, not zeros
    for result, setting in [(xpress, "T=0 batch=1"), (xpress, "T=0 batch=8"), (dynamic, "T=0 batch=8")]:
        assert result[setting]["outputs"][0] == plain[setting]["outputs"][0], setting  # [0]: the first (only) repeat
        assert all(len(tokens) > 0 for tokens in result[setting]["outputs"][0])
        # Held-out measurements give τ 2.2 at K = 3; a drafter that ran wrong would still be exact, at τ near 1.
        assert result[setting]["tau"] > 1.6, (setting, result[setting]["tau"])
    # The dynamic run drafted only in its tail: far fewer drafts than tokens.
    assert 0 < dynamic["T=0 batch=8"]["drafts"] < dynamic["T=0 batch=8"]["new_tokens"][0] / 4


def test_a_release_serving_folder_serves_greedy_identical(vllm_python, prompts_file, target_dir, tmp_path):
    """An xPress release serving folder (the authors' format, `Qwen3XPressModel`: a dFlash config and `xpress_head.*`
    tensors, here written by `write_xpress_release` for a random QK-norm drafter with a random head) serves through
    the plugin without conversion: its head is loaded (not zeros) and runs, and greedy output is vLLM plain's."""
    import torch
    from transformers import AutoConfig

    from modeling_xpress import XPressConfig, XPressModel
    from modeling_xpress.conversion import write_xpress_release

    torch.manual_seed(0)
    config = XPressConfig.from_target_config(
        AutoConfig.from_pretrained(target_dir), num_hidden_layers=1, mask_token_id=0, target_layer_ids=[1, 27],
        qk_norm=True, refiner_rank=32, refiner_mlp_hidden=48,
    )  # fmt: skip
    xpress = XPressModel(config)
    with torch.no_grad():
        for p in xpress.refiner.parameters():
            p.normal_(std=0.05)
    folder = write_xpress_release(xpress, tmp_path / "release")
    settings = ("--batches", "1", "4", "--temperatures", "0", "--k", "3", "--max-tokens", "24")
    plain = run_engine(vllm_python, "plain", prompts_file, tmp_path / "plain.json", target_dir, *settings)
    served = run_engine(vllm_python, "xpress", prompts_file, tmp_path / "release.json", target_dir, *settings,
                        checkpoint=folder)  # fmt: skip
    assert served["drafter"]["model"] == "XPressDFlashForCausalLM" and served["drafter"]["head"] == "XPressRefiner"
    assert served["drafter"]["head_sum"] > 0
    for setting in ("T=0 batch=1", "T=0 batch=4"):
        assert served[setting]["outputs"][0] == plain[setting]["outputs"][0], setting
        assert served[setting]["drafts"] > 0


def test_sampling_accepts_drafts_with_the_heads_q(vllm_python, prompts_file, target_dir, tmp_path):
    """T=1 with probabilistic drafts: vLLM's rejection sampler is handed each draft's q (refine_proposals, tested
    against XPressModel.refine in test_vllm_refine.py). Without the plugin's CPU fix (xpress_vllm/fixes.py) vLLM
    divided the target's logits by garbage temperatures here and accepted almost nothing (τ 1.02 measured)."""
    settings = ("--batches", "4", "--temperatures", "1", "--max-tokens", "40", "--draft-sampling", "probabilistic")
    result = run_engine(vllm_python, "xpress", prompts_file, tmp_path / "t1.json", target_dir, *settings)
    assert result["T=1 batch=4"]["new_tokens"][0] > 0
    assert result["T=1 batch=4"]["tau"] > 1.3, result["T=1 batch=4"]["tau"]  # 1.57 measured at batch 1


def seeded_runs(vllm_python, target_dir, prompts_file, out, method: str, *extra) -> dict:
    command = [str(vllm_python), str(REPO / "tests" / "vllm_seed_engine.py"), str(target_dir), str(prompts_file),
               str(out), "--method", method, "--checkpoint", str(CHECKPOINT), *extra]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=REPO,
                          env=vllm_env())  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    return json.loads(Path(out).read_text())


def test_a_seeded_request_gives_one_text_alone_and_in_any_batch(vllm_python, prompts_file, target_dir, tmp_path):
    """A request with a `seed` at T=1 and T=0.7 (probabilistic drafts, K = 3): sent alone three times and inside
    batches of different compositions (greedy, unseeded and other-seeded requests around it, at other positions, a
    second copy of itself), it gives one text with the xPress drafter, as it does on vLLM plain. The head's draft
    noise comes from the request's seed (`refine.draft_noise_seed`); before, from the global RNG: 3 texts of 3.

    What vLLM 0.32 promises is this, reproducibility per request: its rejection sampler draws from the request's
    generator (a uniform per draft, noise for the recovered token) where plain sampling draws once per token, so a
    seeded request's text with speculation is not its text without (measured: not equal here, not asserted)."""
    xpress = seeded_runs(vllm_python, target_dir, prompts_file, tmp_path / "xpress.json", "xpress")
    plain = seeded_runs(vllm_python, target_dir, prompts_file, tmp_path / "plain.json", "plain")
    assert xpress["drafts"] > 0
    for temperature in ("T=1", "T=0.7"):
        for result in (plain, xpress):
            texts = {tuple(tokens) for case, runs in result.items() if case.startswith(temperature + " ")
                     for tokens in runs}  # fmt: skip
            assert len(texts) == 1 and len(next(iter(texts))) > 0, (temperature, result)
        same = xpress[f"{temperature} alone 1"] == plain[f"{temperature} alone 1"]
        print(temperature, "xPress text equals plain's:", same)
    # `make serve`'s dynamic schedule (drafts only while at most 2 requests run): the same request sent again alone
    # gives one text. In a larger batch its first steps draft nothing and sample plainly, where alone they verify
    # drafts: another text there, as with any vLLM speculative method under that schedule (printed, not asserted).
    dynamic = seeded_runs(vllm_python, target_dir, prompts_file, tmp_path / "dyn.json", "xpress", "--schedule", "2",
                          "--temperatures", "1")  # fmt: skip
    assert dynamic["T=1 alone 1"] == dynamic["T=1 alone 2"] == dynamic["T=1 alone 3"]
    print("dynamic schedule, texts in all cases:",
          len({tuple(t) for case, runs in dynamic.items() if case != "drafts" for t in runs}))  # fmt: skip


def test_errors_for_what_the_plugin_cannot_honour(vllm_python, prompts_file, tmp_path):
    """A checkpoint built for another target, and more drafts than a block holds, fail at load with what to do."""
    target = tiny_llama(vocab_size=96)
    target.save_pretrained(tmp_path / "tiny-target")
    tiny_tokenizer(96).save_pretrained(tmp_path / "tiny-target")
    tiny_prompts = tmp_path / "tiny-prompts.json"
    tiny_prompts.write_text(json.dumps({"prompt_token_ids": [[1, 2, 3]]}))
    done = run_engine(vllm_python, "xpress", tiny_prompts, tmp_path / "x.json", tmp_path / "tiny-target",
                      "--batches", "1", "--temperatures", "0", "--max-model-len", "256", check=False)  # fmt: skip
    assert done.returncode != 0
    assert "built for a different target model" in done.stdout, done.stdout[-3000:]


def test_unsupported_vllm_and_tensor_parallelism_fail_with_what_to_do(vllm_python):
    """A vLLM release outside SUPPORTED_VLLM, and tensor parallelism (untested), stop the drafter's construction with
    the fix in the message. Driven in .venv-vllm without an engine: vLLM's version is patched, and so is the
    tensor-parallel world size the drafter class reads."""
    script = """
import vllm, xpress_vllm, xpress_vllm.model as model
from xpress_vllm.model import XPressDFlashForCausalLM
assert xpress_vllm.vllm_version_supported(vllm.__version__) and not xpress_vllm.vllm_version_supported("0.33.0")
supported = vllm.__version__
vllm.__version__ = "0.33.0"
try:
    XPressDFlashForCausalLM(vllm_config=None)
except RuntimeError as error:
    print("VERSION:", error)
vllm.__version__ = supported
model.get_tensor_model_parallel_world_size = lambda: 2
try:
    XPressDFlashForCausalLM(vllm_config=None)
except NotImplementedError as error:
    print("TP:", error)
"""
    done = subprocess.run([str(vllm_python), "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, cwd=REPO, env=vllm_env())  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "VERSION: xpress_vllm supports vLLM 0.32.x, but vLLM 0.33.0 is installed. Install a supported" in done.stdout
    assert "TP: xpress_vllm is tested with tensor_parallel_size=1 only" in done.stdout, done.stdout[-3000:]
    assert "Serve with --tensor-parallel-size 1" in done.stdout



def test_a_drafter_with_sliding_windows_is_refused_with_what_to_do(vllm_python, tmp_path):
    """The plugin does not pass `attention_windows` to vLLM's layers, so such a checkpoint stops the drafter's
    construction (driven without an engine: a stand-in for vLLM's config) instead of serving another function."""
    target = tiny_llama(vocab_size=96)
    tiny_xpress(target, mask_token_id=0, attention_windows=[None, 9]).save_pretrained(tmp_path / "windowed")
    script = f"""
from types import SimpleNamespace as NS
from transformers import LlamaConfig
import xpress_vllm.model as model
model.get_tensor_model_parallel_world_size = lambda: 1
spec = NS(draft_model_config=NS(model={str(tmp_path / "windowed")!r}, revision=None), num_speculative_tokens=3)
config = NS(speculative_config=spec, model_config=NS(hf_config=LlamaConfig(**{target.config.to_diff_dict()!r})))
try:
    model.XPressDFlashForCausalLM(vllm_config=config)
except ValueError as error:
    print("WINDOWS:", error)
"""
    done = subprocess.run([str(vllm_python), "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, cwd=REPO, env=vllm_env())  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "WINDOWS: This xPress drafter has sliding-window layers (attention_windows=[None, 9])" in done.stdout, done.stdout[-3000:]
    assert "write it with modeling_xpress.conversion.write_dflash_checkpoint" in done.stdout

def test_other_gemma_targets_are_refused_with_what_to_do(vllm_python, tmp_path):
    """The plugin serves Gemma-3 text targets (below). vLLM 0.32's other Gemma models (Gemma, Gemma 2, Gemma-3n and
    the multimodal Gemma-3) give a dFlash drafter no hidden states: a Gemma 2 target stops the drafter's construction
    with what to use instead (driven without an engine: a stand-in for vLLM's config), and the check passes a
    Gemma-3 text target and refuses a multimodal Gemma-3 one."""
    target = tiny_gemma3(vocab_size=96)
    tiny_xpress(target, mask_token_id=0).save_pretrained(tmp_path / "xpress")
    shape = {k: getattr(target.config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim",
                                                    "num_attention_heads", "num_key_value_heads")}  # fmt: skip
    script = f"""
from types import SimpleNamespace as NS
from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig
import xpress_vllm.model as model
model.get_tensor_model_parallel_world_size = lambda: 1
spec = NS(draft_model_config=NS(model={str(tmp_path / "xpress")!r}, revision=None), num_speculative_tokens=3)
config = NS(speculative_config=spec, model_config=NS(hf_config=Gemma2Config(**{shape!r})))
try:
    model.XPressDFlashForCausalLM(vllm_config=config)
except ValueError as error:
    print("GEMMA2:", error)
model.check_served_target(Gemma3TextConfig(**{shape!r}))
try:
    model.check_served_target(Gemma3Config(text_config={shape!r}))
except ValueError as error:
    print("GEMMA3-MULTIMODAL:", error)
"""
    done = subprocess.run([str(vllm_python), "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, cwd=REPO, env=vllm_env())  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "GEMMA2: xpress_vllm serves Gemma-3 text models (model_type 'gemma3_text'" in done.stdout, done.stdout
    assert "but not a ['gemma2'] target" in done.stdout
    assert "spec_generate(target, input_ids, compile=True)" in done.stdout
    assert "GEMMA3-MULTIMODAL: xpress_vllm serves Gemma-3 text models" in done.stdout
    assert "but not a ['gemma3', 'gemma3_text'] target" in done.stdout


def test_the_drafter_embeds_as_transformers_gemma3_does(vllm_python):
    """vLLM hands the drafter the target's embedding table, and its Gemma-3 scales by √H outside it; the drafter's
    `embed_input_ids` must give what `XPressModel.embed_blocks` gives through transformers' Gemma-3 embedding, bit for
    bit in float32 and bfloat16 (where the scale is rounded to the table's dtype first: √640 is 25.25 there), with a
    learned mask vector (not scaled) and with a mask token (scaled). Driven without an engine: the drafter model's
    method on a stand-in holding the table."""
    script = """
import torch
from types import SimpleNamespace as NS
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from modeling_xpress import XPressConfig, XPressModel
from xpress_vllm.model import XPressDFlashModel, target_embedding_scale
torch.manual_seed(0)
target = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=96, hidden_size=640, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=1, num_key_value_heads=1, head_dim=32))
anchors = torch.tensor([[7, 11, 95]])
for dtype in (torch.float32, torch.bfloat16):
    for mask_token_id in (None, 5):
        xpress = XPressModel(XPressConfig.from_target_config(target.config, num_hidden_layers=1, block_size=4,
                                                             mask_token_id=mask_token_id))
        if mask_token_id is None:
            torch.nn.init.normal_(xpress.mask_embedding)
        table = target.to(dtype).get_input_embeddings()
        expected = xpress.to(dtype).embed_blocks(anchors, table)[0]  # (3 * 4, H): [anchor, mask x 3] per block
        mask_id = 96 if mask_token_id is None else mask_token_id  # XPressVLLMConfig's mask id
        ids = torch.tensor([[a, mask_id, mask_id, mask_id] for a in anchors[0].tolist()]).view(-1)
        drafter = NS(embed_tokens=torch.nn.Embedding.from_pretrained(table.weight), mask_token_id=mask_id,
                     embed_scale=target_embedding_scale(target.config), mask_embedding=xpress.mask_embedding,
                     has_separate_mask_embedding=mask_token_id is None)
        got = XPressDFlashModel.embed_input_ids(drafter, ids)
        assert got.dtype == dtype and torch.equal(got, expected), (dtype, mask_token_id, (got - expected).abs().max())
        print("equal", dtype, mask_token_id)
"""
    done = subprocess.run([str(vllm_python), "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, cwd=REPO, env=vllm_env())  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.count("equal") == 4, done.stdout[-3000:]


GEMMA_K = 3


@pytest.fixture(scope="module")
def tiny_gemma_pair(tmp_path_factory) -> Path:
    """A tiny random Gemma-3 target (five sliding-window layers of 8 tokens, shorter than the prompts, to one global;
    head_dim 32 for vLLM's CPU attention) with a tokenizer, an xPress drafter for it with a learned mask vector and
    blocks of K + 1 (what vLLM drafts, so that transformers' draft of a block is the same computation) reading layers
    1 and 3, and four prompts of 3, 12, 20 and 33 tokens; all in one folder."""
    import torch

    folder = tmp_path_factory.mktemp("gemma")
    target = tiny_gemma3(vocab_size=96, head_dim=32)
    target.save_pretrained(folder / "target")
    tiny_tokenizer(96).save_pretrained(folder / "target")
    tiny_xpress(target, mask_token_id=None, block_size=GEMMA_K + 1, target_layer_ids=[1, 3]).save_pretrained(
        folder / "xpress")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 12, 20, 33)]
    (folder / "prompts.json").write_text(json.dumps({"prompt_token_ids": prompts}))
    return folder


def transformers_proposals(target, xpress, prompt: list[int], tokens: list[int], k: int) -> list[list[int]]:
    """The proposals of a greedy run that emitted `tokens` after `prompt`, made by transformers' target and
    `XPressModel` (`drafting.draft_block`): at each step the drafter reads the target's hidden states of the committed
    tokens before the anchor and drafts k tokens after it; the step then commits the drafts that match `tokens` and
    one more, whose last is the next anchor."""
    import torch
    from transformers import DynamicCache

    from modeling_xpress.drafting import draft_block, target_features

    sequence, n, proposals = prompt + tokens, 0, []
    while n < len(tokens):
        anchor = len(prompt) + n  # the anchor's index in the sequence
        with torch.no_grad():
            hidden = target(torch.tensor([sequence[:anchor]]), output_hidden_states=True).hidden_states
            features = target_features(hidden, xpress.config.target_layer_ids, anchor)
            last = torch.tensor([sequence[anchor - 1 : anchor + 1]])
            drafts = draft_block(xpress, target.get_input_embeddings(), target.lm_head, last, features, 0,
                                 DynamicCache(), positions=k).tokens[0].tolist()  # fmt: skip
        proposals.append(drafts)
        accepted = 0
        while accepted < k and n + 1 + accepted < len(tokens) and drafts[accepted] == tokens[n + 1 + accepted]:
            accepted += 1
        n += accepted + 1
    return proposals


def test_a_gemma3_target_serves_greedy_identical_with_transformers_drafts(vllm_python, tiny_gemma_pair, tmp_path):
    """On a Gemma-3 target vLLM 0.32 alone cannot run a dFlash drafter: its Gemma-3 returns no hidden states for one,
    and the drafter would embed without Gemma's √H scale (docs/vllm.md). With the plugin's target class and scale:
    greedy output equals vLLM plain's, alone and at batch 4 (prompts and outputs longer than the sliding window), and
    every proposal the drafter made in vLLM is the one transformers' Gemma-3 and `XPressModel` make after the same
    tokens: the hidden states vLLM hands the drafter are transformers' `output_hidden_states` and the block is
    embedded as in training. Measured when it was written: 64 of 64 proposals equal; without the scale 15; with each
    layer's output missing its residual stream 0. The drafter's context is written in every step (its cache shares
    bytes with sliding-window layers', `context.context_can_wait`)."""
    from transformers import AutoModelForCausalLM

    from modeling_xpress import XPressModel

    folder = tiny_gemma_pair
    prompts = json.loads((folder / "prompts.json").read_text())["prompt_token_ids"]
    plain = run_engine(vllm_python, "plain", folder / "prompts.json", tmp_path / "plain.json", folder / "target",
                       "--batches", "1", "4", "--temperatures", "0", "--max-tokens", "16", "--max-model-len", "256")
    command = [str(vllm_python), str(REPO / "tests" / "vllm_drafts_engine.py"), str(folder / "target"),
               str(folder / "xpress"), str(folder / "prompts.json"), str(tmp_path / "drafts.json"), "--k", str(GEMMA_K),
               "--max-tokens", "16"]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=REPO,
                          env=vllm_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1"))  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    served = json.loads((tmp_path / "drafts.json").read_text())
    assert served["classes"] == {"target": "Gemma3ForCausalLMWithAux", "drafter": "XPressDFlashForCausalLM"}
    # Sliding-window and full layers: KV-cache groups whose tensors vLLM overlays, so no context write may wait
    # (`context.context_can_wait`; a kept write landed in the target's cache on the real pair)
    assert served["context_waits"] is False
    assert [run["tokens"] for run in served["alone"]] == plain["T=0 batch=1"]["outputs"][0]
    assert served["together"] == plain["T=0 batch=4"]["outputs"][0]
    assert all(len(tokens) == 16 for tokens in served["together"]) and served["drafts"] > 0
    target = AutoModelForCausalLM.from_pretrained(folder / "target", dtype="float32").eval()
    xpress = XPressModel.from_pretrained(folder / "xpress", dtype="float32").eval()
    for prompt, run in zip(prompts, served["alone"]):
        expected = transformers_proposals(target, xpress, prompt, run["tokens"], GEMMA_K)
        assert run["proposals"] == expected, (prompt, run["proposals"], expected)


def test_too_many_drafts_for_the_block(vllm_python, prompts_file, target_dir, tmp_path):
    done = run_engine(vllm_python, "xpress", prompts_file, tmp_path / "x.json", target_dir, "--k", "16",
                      "--batches", "1", "--temperatures", "0", check=False)  # fmt: skip
    assert done.returncode != 0
    assert "Pass num_speculative_tokens <= 15" in done.stdout, done.stdout[-3000:]


CHI2_DRAWS = 2000
CHI2_PROMPT = [0, 2, 1, 1]


def sample_through_vllm(vllm_python, folder: Path, out, *, keep_cpu_expand=False):
    env = vllm_env(XPRESS_VLLM_KEEP_CPU_EXPAND="1" if keep_cpu_expand else "0")
    command = [str(vllm_python), str(REPO / "tests" / "vllm_sampling_engine.py"), str(folder / "target"),
               str(folder / "xpress"), str(out), "--samples", str(CHI2_DRAWS),
               "--prompt", *map(str, CHI2_PROMPT)]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-4000:]
    return json.loads(Path(out).read_text())


def save_lossless_case(target, folder: Path, target_layer_ids: list[int]) -> dict[tuple[int, ...], float]:
    """Save a tiny target over 3 tokens with a tokenizer (`folder/target`) and a random xPress drafter with a random
    head for it (`folder/xpress`); return the target's exact distribution of the 27 continuations of CHI2_PROMPT."""
    import torch

    target.save_pretrained(folder / "target")
    tiny_tokenizer(3).save_pretrained(folder / "target")
    # vLLM reads a target layer's output as the next layer's input, so the last layer cannot be one of them.
    xpress = tiny_xpress(target, refiner="xpress", block_size=4, jacobi_max_iters=2, seed=5,
                         target_layer_ids=target_layer_ids)  # fmt: skip
    xpress.save_pretrained(folder / "xpress")
    prompt = torch.tensor([CHI2_PROMPT])
    seqs = torch.tensor([[a, b, c] for a in range(3) for b in range(3) for c in range(3)])
    with torch.no_grad():
        logits = target(torch.cat([prompt.expand(len(seqs), -1), seqs], 1)).logits[:, len(CHI2_PROMPT) - 1 : -1]
    logp = logits.float().log_softmax(-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1).sum(-1)
    exact = {tuple(s.tolist()): float(p) for s, p in zip(seqs, logp.exp())}
    assert max(exact.values()) < 0.6, "the target must spread its mass for the test to have power"
    return exact


def chi2_pvalue(result, exact: dict[tuple[int, ...], float]) -> float:
    from tests.test_sampling import chi_square_pvalue

    samples = [tuple(s) for s in result["sequences"]]
    return 0.0 if any(s not in exact for s in samples) else chi_square_pvalue(samples, exact)


def test_sampling_through_vllm_is_lossless(vllm_python, tmp_path):
    """χ² through vLLM itself: a tiny peaked Llama target (3 tokens, head_dim 32 for vLLM's CPU attention) and a random
    xPress drafter with a random head, 2000 seeded T=1 continuations of 3 tokens (the last two from verified drafts).
    The same test rejects vLLM's own CPU kernel that xpress_vllm/fixes.py replaces (its power check)."""
    import torch

    target = tiny_llama(vocab_size=3, seed=11, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        # peaked and position-dependent, as in test_sampling.py; at this width (128) a scale of 6 leaves 1.9 nats over
        # the 27 continuations (60 put 0.9999 on one: a test without power, and drafts never accepted)
        target.lm_head.weight.mul_(6.0)
    exact = save_lossless_case(target, tmp_path, target_layer_ids=[0, 1])
    fixed = sample_through_vllm(vllm_python, tmp_path, tmp_path / "fixed.json")
    assert fixed["drafts"] > 0 and 0 < fixed["accepted"] < 3 * fixed["drafts"]  # drafts were verified, some rejected
    assert chi2_pvalue(fixed, exact) > 1e-3
    broken = sample_through_vllm(vllm_python, tmp_path, tmp_path / "broken.json", keep_cpu_expand=True)
    assert chi2_pvalue(broken, exact) < 1e-3


def test_sampling_on_a_gemma3_target_is_lossless(vllm_python, tmp_path):
    """The χ² test above on a tiny Gemma-3 target, served with the plugin's target class: sliding windows of 4 tokens,
    so the window moves over the prompt's 4 tokens while the 3 sampled ones are drafted, verified and rejected."""
    import torch

    target = tiny_gemma3(vocab_size=3, sliding_window=4, head_dim=32, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.5)  # (tied to the embedding table) 2.4 nats over the 27 continuations
    exact = save_lossless_case(target, tmp_path, target_layer_ids=[1, 3])
    result = sample_through_vllm(vllm_python, tmp_path, tmp_path / "gemma.json")
    assert result["drafts"] > 0 and 0 < result["accepted"] < 3 * result["drafts"]
    assert chi2_pvalue(result, exact) > 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_serve_answers_an_openai_chat_request(vllm_python, target_dir):
    """`make serve` (here with --enforce-eager for a quick start) and examples/vllm_client.py, on loopback."""
    port = free_port()
    server = subprocess.Popen(["make", "-s", "serve", f"PORT={port}", "SERVE_ARGS=--enforce-eager --host 127.0.0.1"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=vllm_env(),
                              start_new_session=True)  # fmt: skip
    try:
        done = subprocess.run([sys.executable, str(REPO / "examples" / "vllm_client.py"), "--url",
                               f"http://127.0.0.1:{port}", "--wait", "400", "--max-tokens", "24",
                               "What is the capital of France?"], capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            log = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            log = server.communicate()[0]
    assert done.returncode == 0, done.stderr[-2000:] + log[-4000:]
    assert "Paris" in done.stdout, done.stdout
    assert "Resolved architecture: XPressModel" in log, log[-4000:]  # the xPress checkpoint drafts
