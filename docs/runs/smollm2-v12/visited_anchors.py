# v12 (issue 46): the anchors greedy decoding visits in training rows, with a checkpoint's drafter
# argmax (head off): a block at anchor t accepts the leading drafts equal to the target's argmax, the next starts after.
import json, sys, time, torch
from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import load_smollm2
from modeling_xpress.training.signal_cache import load_signal_cache
from modeling_xpress.training import draft_blocks
torch.set_num_threads(2)
ckpt, cache, lo_row, hi_row, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
target, _ = load_smollm2(torch.bfloat16)
x = XPressModel.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
rows = load_signal_cache(cache)
embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
n = x.config.block_size - 1
try:
    done = json.load(open(out))
except FileNotFoundError:
    done = {}
t0 = time.time()
with torch.no_grad():
    for i in range(lo_row, hi_row):
        if str(i) in done:
            continue
        row = rows[i]
        ids = torch.as_tensor(row["input_ids"]).long(); mask = torch.as_tensor(row["loss_mask"]).bool()
        full = len(ids)
        f = torch.as_tensor(row["features"]); f = f.view(torch.bfloat16) if f.dtype == torch.int16 else f
        f = f.view(full, -1)
        top1 = torch.as_tensor(row["topk_ids"]).long().view(full, -1)[:, 0]
        anchors = (mask[:-1] & mask[1:]).nonzero().flatten()
        tau = {}
        for lo in range(0, len(anchors), 32):
            a = anchors[lo: lo + 32]
            h = draft_blocks(x, embed, f[None], a[None], ids[a][None])[0]
            d = x.base_logits(h.to(lm_head.weight.dtype), lm_head).argmax(-1)  # (m, n)
            pos = a[:, None] + torch.arange(n)  # distribution of block position k lives at t + k - 1
            ok = (a[:, None] + 1 + torch.arange(n)) < full
            ok &= mask[(a[:, None] + 1 + torch.arange(n)).clamp(max=full - 1)]
            match = (d == top1[pos.clamp(max=full - 1)]) & ok
            for t, m in zip(a.tolist(), match.long().cumprod(-1).sum(-1).tolist()):
                tau[t] = 1 + m
        visit, t = [], int(anchors[0]) if len(anchors) else full
        while t in tau:
            visit.append(t); t += tau[t]
        done[str(i)] = visit
        if (i + 1) % 50 == 0:
            json.dump(done, open(out, "w")); print(f"row {i + 1}: {time.time() - t0:.0f}s", flush=True)
json.dump(done, open(out, "w"))
print("done", time.time() - t0)
