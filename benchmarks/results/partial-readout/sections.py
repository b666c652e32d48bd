"""Per-block section times of `spec_generate(compile=True)` with 3 drafts per block, head on and off (K=0).

The probe behind the partial-readout A/B (issue 10): run it once on the commit before the change and once after, in
turn, with nothing else running (the package is imported from the working tree that runs it):

    (cd <worktree of 17f4222> && PYTHONPATH=. python <this file> --checkpoint <v6 xpress> --out before.json)
    python benchmarks/results/partial-readout/sections.py --checkpoint <v6 xpress> --out after.json

The v6 xPress checkpoint (`--checkpoint`, default the bundled one), bf16, 2 threads, the first 4 task-shaped held-out
prompts, 96 new tokens each after a warm-up.
"""

import argparse
import json
import subprocess

import torch

from modeling_xpress import XPressModel
from modeling_xpress.assets import load_smollm2
from modeling_xpress.benchmark import chat_prompt_ids
from modeling_xpress.demo import BUNDLED_CHECKPOINT
from modeling_xpress.prompts import TASK_KINDS
from modeling_xpress.regeneration import held_out_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--checkpoint", default=str(BUNDLED_CHECKPOINT))
args = parser.parse_args()
torch.set_num_threads(2)
target, tokenizer = load_smollm2(dtype=torch.bfloat16)
xpress = XPressModel.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()
prompts = chat_prompt_ids(tokenizer, held_out_prompts(4, kinds=TASK_KINDS))
kwargs = {"compile": True, "num_assistant_tokens": 3, "max_cache_len": 512}
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
result = {"commit": commit, "checkpoint": args.checkpoint, "ms_per_block": {}}
for jacobi_max_iters in (xpress.config.jacobi_max_iters, 0):
    xpress.config.jacobi_max_iters = jacobi_max_iters
    totals, blocks = {}, 0
    with torch.inference_mode():
        xpress.spec_generate(target, prompts[0], max_new_tokens=32, **kwargs)  # compiles this setting's graphs
        for ids in prompts:
            stats = xpress.spec_generate(target, ids, max_new_tokens=96, **kwargs).stats
            blocks += len(stats.draft_lengths)
            for section in ("drafter", "lm_head", "refiner", "verify"):
                totals[section] = totals.get(section, 0.0) + stats.seconds(section)
    times = {section: round(1000 * seconds / blocks, 3) for section, seconds in totals.items()}
    result["ms_per_block"][f"K={jacobi_max_iters}"] = {**times, "blocks": blocks}
    print(f"K={jacobi_max_iters}: {times}, {blocks} blocks", flush=True)
with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
