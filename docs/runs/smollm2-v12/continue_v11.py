# v12 (issue 46): continue v11 on ROWS rows of its training data, anchors drawn from the blocks greedy decoding visits
# (ANCHORS=visited) or uniformly (ANCHORS=uniform, the control). FIRST=4000 (with --max_train_samples 10200): the rows
# FIRST..FIRST+ROWS of the same shuffle instead, which v10-v12 never read, with their own --signal_cache (the two
# runs' scripts merged into one; the same calls).
import json, os
from transformers import HfArgumentParser
from modeling_xpress.training import XPressTrainingArguments, XPressTrainer
from modeling_xpress.training.run import RunArguments, load_target, load_data, build_drafter, cached_signals, held_out_cache_folder
import torch
args, targs = HfArgumentParser((RunArguments, XPressTrainingArguments)).parse_args_into_dataclasses()
torch.set_num_threads(args.threads)
target = load_target(args, targs.seed)
data, held_out = load_data(args, target, targs.seed)
xpress = build_drafter(args, target, data)
layers = xpress.config.target_layer_ids
rows, first = int(os.environ["ROWS"]), int(os.environ.get("FIRST", 0))
if first:  # rows never trained on: a cache of just those rows; the held-out rows' cache is v10's
    data = cached_signals(args, targs, target, data.select(range(first, first + rows)), layers, args.signal_cache)
    held_out = cached_signals(args, targs, target, held_out, layers, "cache/signals-smollm2-v10-held-out")
else:
    data = cached_signals(args, targs, target, data, layers, args.signal_cache).select(range(rows))
    held_out = cached_signals(args, targs, target, held_out, layers, held_out_cache_folder(args.signal_cache))
if os.environ["ANCHORS"] == "visited":  # 1 on the positions the walk visited, 0 elsewhere
    visited = json.load(open(os.environ["VISITED"]))
    weights = []
    for i, ids in enumerate(data["input_ids"]):
        w = torch.zeros(len(ids))
        w[visited[str(i)]] = 1.0
        weights.append(w.tolist())
    data = data.add_column("anchor_weights", weights)
print(f"{len(data)} rows, anchors {os.environ['ANCHORS']}, {xpress.config.refiner_form} head rank {xpress.config.refiner_rank}", flush=True)
trainer = XPressTrainer(model=xpress, target=target, args=targs, train_dataset=data, eval_dataset=held_out)
trainer.train()
trainer.save_model()
