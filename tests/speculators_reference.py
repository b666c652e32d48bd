"""speculators' side of tests/test_speculators.py, run by .venv-vllm's Python (speculators pins transformers <= 5.19).

    python tests/speculators_reference.py JOBS.json

Each job writes a torch file with speculators' own block logits (its training forward, `_backbone_forward`, at one
anchor: the drafter function speculators trains) for `ids`:

* {"mode": "train", "folder", "target", "out", "layer_types", "sliding_window", "non_causal", "draft_vocab"}: a DFlash
  drafter built by speculators with random weights for the target folder `target`, saved to `folder`;
* {"mode": "load", "folder", "out"}: the folder loaded by speculators' `DFlashDraftModel.from_pretrained`;
* {"mode": "vllm", "folder", "out"}: what vLLM makes of the folder (its speculators config reader), no logits;
* {"mode": "serve", "folder", "prompt", "max_tokens", "out"}: vLLM serving the folder as its model (it serves the
  verifier with the folder as its drafter), greedy, and the same prompt on the verifier alone: tokens, drafts, accepted
  drafts. Run with VLLM_PLUGINS="" (no plugin).
"""

import json
import sys

import torch


def block_logits(model, target, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """speculators' training forward with the single anchor `anchor`: the logits of the block's B slots."""
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i] for i in model.config.aux_hidden_state_layer_ids], dim=-1)
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, anchor] = 1  # the one position `select_anchors` can pick
        _, logits, _, _, blocks = model._backbone_forward(
            features, ids, loss_mask, hs[-1], torch.zeros_like(ids), max_anchors=1
        )
    assert blocks[0].item() == anchor, blocks
    return logits[0].float()


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue  # the verifier's, loaded from the target
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)


def train(job, target_model):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    tc = target_model.config
    layer = Qwen3Config(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, layer_types=job["layer_types"],
                        sliding_window=job["sliding_window"], use_sliding_window=job["sliding_window"] is not None)  # fmt: skip
    layer._attn_implementation = "eager"  # its float masks; flex attention needs a compiler
    vocab = job["draft_vocab"] or tc.vocab_size
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=vocab, block_size=6, aux_hidden_state_layer_ids=[2, 4],
        mask_token_id=7, sliding_window_non_causal=job["non_causal"],
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=5)],
            verifier=VerifierConfig.from_pretrained(job["target"]),
        ),
    )  # fmt: skip
    model = DFlashDraftModel(config)
    if job["draft_vocab"]:  # every third token, as speculators' vocabulary mapping stores it
        ids = torch.arange(0, tc.vocab_size, 3)[:vocab]
        model.load_vocab_mappings(torch.zeros(tc.vocab_size, dtype=torch.bool).index_fill_(0, ids, True),
                                  ids - torch.arange(vocab))  # fmt: skip
    model.load_verifier_weights()
    randomize(model, job.get("seed", 0))
    model.save_pretrained(job["folder"])
    return model.eval()


def load(job):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    from safetensors.torch import load_file

    config = DFlashSpeculatorConfig.from_pretrained(job["folder"])
    config.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(job["folder"], config=config)
    for name in ("fc.weight", "lm_head.weight", "embed_tokens.weight"):
        assert not model.state_dict()[name].isnan().any(), name
    stored = set(load_file(f"{job['folder']}/model.safetensors"))
    return model.eval(), {"unexpected_keys": sorted(stored - set(model.state_dict()))}


def vllm_view(job) -> dict:
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.loads(open(f"{job['folder']}/config.json").read())
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    return {"hf_config": hf, "speculative": SpeculatorsConfig.extract_vllm_speculative_config(raw)}


def serve(job) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    raw = json.loads(open(f"{job['folder']}/config.json").read())
    out = {}
    for name, model in (("plain", raw["speculators_config"]["verifier"]["name_or_path"]), ("speculators", job["folder"])):
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.2, seed=0,
                  disable_log_stats=False)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
        done = llm.generate([TokensPrompt(prompt_token_ids=job["prompt"])], params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        spec = llm.llm_engine.vllm_config.speculative_config
        out[name] = {"tokens": list(done[0].outputs[0].token_ids), "method": getattr(spec, "method", None),
                     "drafts": metrics.get("vllm:spec_decode_num_drafts"),
                     "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens")}  # fmt: skip
        del llm
    return out


def main(path: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    targets = {}
    for job in json.loads(open(path).read()):
        if job["mode"] in ("vllm", "serve"):
            torch.save((vllm_view if job["mode"] == "vllm" else serve)(job), job["out"])
            continue
        folder_config = None if job["mode"] == "train" else json.loads(open(f"{job['folder']}/config.json").read())
        target_dir = job.get("target") or folder_config["speculators_config"]["verifier"]["name_or_path"]
        if target_dir not in targets:
            targets[target_dir] = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        target = targets[target_dir]
        info = {}
        model = train(job, target) if job["mode"] == "train" else None
        if model is None:
            model, info = load(job)
        ids = torch.randint(0, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
        anchor = 13
        torch.save({"ids": ids, "anchor": anchor, "logits": block_logits(model, target, ids, anchor),
                    "loading_info": info}, job["out"])  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
