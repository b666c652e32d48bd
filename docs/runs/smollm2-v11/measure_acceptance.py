"""What the pipeline's measure stage stores, for a folder made outside the pipeline (v11 was trained by its run.sh):
`draft_acceptance` (whole blocks, head on) and `tree_acceptance` (4 / 8 / 16 nodes) on the first 10 held-out task
prompts, fp32 greedy, 96 new tokens, every output checked against plain decoding (`measure_prompt`,
`summarize_acceptance`). Writes a copy of the folder with both in its config (validated as `XPressConfig` does), and
`<out>-measure.json` beside it: the summary, E(c) (tokens per block at c drafts) with the head on and off from the
same whole-block runs, and the per-prompt records (`benchmarks/results/v11/defaults/acceptance-*.json` hold the
summary and E(c) of these files, with the checkpoint and prompts named).

    python docs/runs/smollm2-v11/measure_acceptance.py runs/v11/xpress-compact runs/v11/xpress-measured
"""
import json, shutil, sys, torch
from pathlib import Path
from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.bench.acceptance import measure_prompt, summarize_acceptance
from modeling_xpress.bench.assets import load_gguf_target
from modeling_xpress.bench.benchmark import prompt_ids
from modeling_xpress.bench.demo import bundled_pair
from modeling_xpress.draft_cap import acceptance_from_blocks, expected_tokens
from modeling_xpress.training.prompts import GENERATORS
from modeling_xpress.training.regeneration import held_out_prompts

folder, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.set_num_threads(2)
torch.set_grad_enabled(False)
pair = bundled_pair("smollm2")
target, tokenizer = load_gguf_target(pair.target, dtype=torch.float32)
xpress = XPressModel.from_pretrained(folder, dtype=torch.float32).eval()
prompts = prompt_ids(tokenizer, held_out_prompts(10, kinds=GENERATORS["task"]), chat=pair.chat)
records = []
for i, ids in enumerate(prompts):
    records.append(measure_prompt(target, xpress, ids, 96, [4, 8, 16]))
    print(f"prompt {i}: identical {records[-1]['linear']['identical']}", flush=True)
summary = summarize_acceptance(records, xpress.config.block_size)
if summary["identical"] != summary["outputs"]:
    sys.exit(f"{summary['outputs'] - summary['identical']} outputs differ from the target's own: not writing {out}")
expected = {}
for name, key in (("head_on", "linear"), ("head_off", "head_off")):
    runs = [r[key] for r in records]
    s = acceptance_from_blocks([a for r in runs for a in r["acceptance_lengths"]],
                               [d for r in runs for d in r["draft_lengths"]], xpress.config.block_size)
    expected[f"expected_tokens_per_block_c1_7_{name}"] = [round(expected_tokens(s, c), 4) for c in range(1, 8)]
print(json.dumps(summary | expected))
shutil.copytree(folder, out, dirs_exist_ok=True)
config = XPressConfig.from_pretrained(out)
config.draft_acceptance, config.tree_acceptance = summary["draft_acceptance"], summary["tree_acceptance"]
config.validate_xpress()
config.save_pretrained(out)
(out.parent / f"{out.name}-measure.json").write_text(json.dumps({"summary": summary} | expected | {"records": records}))
