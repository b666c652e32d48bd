"""Teacher-forced greedy acceptance per block position, drafter alone vs drafter + head, paired on the same anchors
of held-out rows (the target's own greedy responses): match_k = argmax == the target's argmax, and the chained
conditional P(match_k | match_<k), which is what greedy decoding's tau is made of."""
import sys, torch
from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import load_smollm2
from modeling_xpress.training.signal_cache import load_signal_cache
from modeling_xpress.training import draft_blocks
from modeling_xpress.training.objective import previous_tokens

torch.set_num_threads(2); torch.set_grad_enabled(False)
target, _ = load_smollm2(torch.float32)
folder, rows_n = sys.argv[1], int(sys.argv[2])
x = XPressModel.from_pretrained(folder, dtype=torch.float32).eval()
rows = load_signal_cache(sys.argv[3])
embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
n = x.config.block_size - 1
vocab_index = torch.full((x.config.vocab_size,), -1, dtype=torch.long)
vocab_index[x.draft_token_ids] = torch.arange(x.draft_token_ids.shape[0])
M = {"base": [], "head": [], "free": []}
V = []
C = {"base": [0, 0], "free": [0, 0]}  # chained greedy: tokens, steps (each block starts where the last one stopped)
for i in range(min(rows_n, len(rows))):
    row = rows[i]
    ids = torch.tensor(row["input_ids"]); mask = torch.tensor(row["loss_mask"], dtype=torch.bool); full = ids.shape[0]
    f = torch.tensor(row["features"]); f = f.view(torch.bfloat16) if f.dtype == torch.int16 else f
    f = f.view(full, -1).float()
    top1 = torch.tensor(row["topk_ids"], dtype=torch.long).view(full, -1)[:, 0]
    first = int(mask.nonzero()[0])
    anchors = [t for t in range(max(first, 1), full - 1) if mask[t + 1]]
    row_match = {"base": [], "free": []}; row_valid = []
    for lo in range(0, len(anchors), 64):
        a = torch.tensor(anchors[lo:lo + 64])
        hidden = draft_blocks(x, embed, f[None], a[None], ids[a][None])[0]
        base = x.draft_logits(hidden, lm_head).float()  # (m, n, Vd)
        pos = (a[:, None] + torch.arange(n)).clamp(max=full - 1)
        valid = ((a[:, None] + 1 + torch.arange(n)) < full) & mask[(a[:, None] + 1 + torch.arange(n)).clamp(max=full - 1)]
        gold_t = top1[pos]  # target's argmax at each position (its greedy response)
        gold_d = vocab_index[gold_t]
        last = torch.stack([ids[a - 1], ids[a]], -1)
        refined = base + x.refiner(hidden, previous_tokens(last, gold_t))
        # the head's greedy fixed point (sequential, = Jacobi converged): feed its own argmax until stable
        tokens = base.argmax(-1)
        for _ in range(n):
            free = base + x.refiner(hidden, previous_tokens(last, x.draft_token_ids[tokens]))
            new = free.argmax(-1)
            if torch.equal(new, tokens): break
            tokens = new
        for name, logits in (("base", base), ("head", refined), ("free", free)):
            M[name].append((logits.argmax(-1) == gold_d) & (gold_d >= 0))
        V.append(valid)
        row_match["base"].append(M["base"][-1] & valid); row_match["free"].append(M["free"][-1] & valid)
    for name in C:
        run = torch.cat(row_match[name]).float().cumprod(-1).sum(-1) + 1
        t = 0
        while t < len(run):
            step = int(run[t]); C[name][0] += step; C[name][1] += 1; t += step
valid = torch.cat(V)
full_blocks = valid.all(-1)
for name in M:
    m = torch.cat(M[name])[full_blocks].float()
    run = m.cumprod(-1)
    tau = 1 + run.sum(-1)
    cond = [run[:, 0].mean().item()] + [(run[:, k].sum() / run[:, k - 1].sum()).item() for k in range(1, 6)]
    print(f"{name}: anchors {m.shape[0]}, uniform greedy tau {tau.mean():.3f}; match_k", " ".join(f"{v:.3f}" for v in m.mean(0)[:6].tolist()),
          "| P(k | <k)", " ".join(f"{c:.3f}" for c in cond))
b, h = torch.cat(M["base"])[full_blocks], torch.cat(M["head"])[full_blocks]
print("position 1: head right & base wrong", int((h[:, 0] & ~b[:, 0]).sum()), " head wrong & base right", int((~h[:, 0] & b[:, 0]).sum()))
for name, (tok, steps) in C.items():
    print(f"chained greedy tau {name}: {tok / steps:.3f} ({steps} blocks)")
print("chained ratio free/base", (C["free"][0] / C["free"][1]) / (C["base"][0] / C["base"][1]))
