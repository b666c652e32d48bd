# v12 (issue 46): the anchors greedy decoding visits in training rows, with a checkpoint's drafter argmax (head off):
# examples/acceptance_diagnostic.py's per-anchor greedy match (`row_acceptance`, head=False) and its walk (`chained`).
# Usage: visited_anchors.py CHECKPOINT CACHE FIRST_ROW END_ROW OUT.json (resumable: rows already in OUT are kept).
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from acceptance_diagnostic import chained, row_acceptance
from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import load_smollm2
from modeling_xpress.training.signal_cache import load_signal_cache

torch.set_num_threads(2)
ckpt, cache, lo_row, hi_row, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
target, _ = load_smollm2(torch.bfloat16)
xpress = XPressModel.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
rows = load_signal_cache(cache)
done = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
t0 = time.time()
for i in range(lo_row, hi_row):
    if str(i) not in done:
        acc = row_acceptance(xpress, target, rows[i], chunk=32, head=False)
        _, _, walk = chained((1 + acc["greedy_head_off"].cumprod(-1).sum(-1)).tolist())
        first = int(torch.as_tensor(rows[i]["loss_mask"]).bool().nonzero()[0])
        done[str(i)] = (acc["offsets"][walk] + first).tolist()
    if (i + 1) % 50 == 0 or i + 1 == hi_row:
        Path(out).write_text(json.dumps(done))
        print(f"row {i + 1}: {time.time() - t0:.0f}s", flush=True)
