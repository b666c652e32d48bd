"""What the pipeline's measure stage stores, for a folder made outside the pipeline (v11 was trained by its run.sh):
`draft_acceptance` (whole blocks, head on) and `tree_acceptance` (4 / 8 / 16 nodes) on the first 10 held-out task
prompts, fp32 greedy, 96 new tokens, every output checked against plain decoding (`measure_prompt`,
`summarize_acceptance`). Writes a copy of the folder with both in its config, and `<out>-measure.json` beside it.

    python docs/runs/smollm2-v11/measure_acceptance.py runs/v11/xpress-compact runs/v11/xpress-measured
"""
import json, shutil, sys, torch
from pathlib import Path
from modeling_xpress import XPressModel
from modeling_xpress.bench.acceptance import measure_prompt, summarize_acceptance
from modeling_xpress.bench.assets import load_gguf_target
from modeling_xpress.bench.benchmark import prompt_ids
from modeling_xpress.bench.demo import bundled_pair
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
print(json.dumps(summary))
shutil.copytree(folder, out, dirs_exist_ok=True)
config = json.loads((out / "config.json").read_text())
config["draft_acceptance"] = summary["draft_acceptance"]
config["tree_acceptance"] = {str(k): v for k, v in summary["tree_acceptance"].items()}
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
(out.parent / f"{out.name}-measure.json").write_text(json.dumps({"summary": summary, "records": records}) + "\n")
