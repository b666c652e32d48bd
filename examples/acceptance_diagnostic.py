"""Why the realised greedy τ sits below the training's τ estimate: per-anchor acceptance on held-out rows.

The training logs `tau_estimate` = 1 + Σ_k Π_{j≤k} (1 − TV_j) averaged over anchors drawn uniformly from the
responses (temperature 1, teacher forced). Decoding measures tokens per verification step. Three things separate
them, and this script puts a number on each, from a held-out signal cache (the target's own greedy responses to
prompts never trained on, with its features and top-k distributions):

1. the metric: T=1 acceptance (1 − TV, of the drafter's own distribution) vs greedy acceptance (the draft equals
   the target's argmax);
2. where the blocks start: every position of a response vs only its first `--positions` tokens;
3. how the blocks are chained: the uniform average over anchors vs the renewal average decoding actually realises
   (each block starts where the previous one stopped, so a position where the drafter fails starts a block and a long
   accepted run is counted once: tokens / steps is a harmonic mean of the per-position τ, not an arithmetic one).

Greedy decoding of the target reproduces the held-out responses (they are its greedy outputs), so the chained greedy
figure is what `spec_generate` would measure on those rows, up to bf16 near-ties and the draft-length cut.

The greedy figures are of the drafts as the checkpoint decodes them (`XPressModel.refine`: with its head, Jacobi as
configured) and, as `*_head_off`, of the drafter's own argmax (`jacobi_max_iters=0`), on the same anchors: a head's
gain over uniform anchors (what training samples) against its gain over the chained blocks (what decoding visits).
The factors greedy τ is made of, P(position k accepted | positions before it accepted), are reported over both.

    python examples/acceptance_diagnostic.py --checkpoint runs/v3/drafter \
        --cache cache/signals-smollm2-v3-held-out --out benchmarks/results/acceptance-diagnostic-v3-drafter.json
"""

import argparse
import json
from pathlib import Path

import torch

from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import load_smollm2
from modeling_xpress.training.signal_cache import load_signal_cache
from modeling_xpress.training import draft_blocks


def chained(tau: list[float], start: int = 0) -> tuple[int, int, list[int]]:
    """Walk a response as decoding does: a block at position t yields tau[t] tokens, the next block starts after them.
    Returns (tokens, steps, the positions the blocks started at)."""
    t, tokens, visited = start, 0, []
    while t < len(tau):
        step = int(round(tau[t]))
        tokens, t = tokens + step, t + step
        visited.append(t - step)
    return tokens, len(visited), visited


@torch.no_grad()
def row_acceptance(xpress, target, row, chunk: int = 64, head: bool = True) -> dict[str, torch.Tensor]:
    """Per response anchor t (the last token before the block): T=1 acceptance (1 − TV, from the stored top-k, a
    lower bound) and greedy match for every block position, of the drafts as decoded (`greedy`) and of the drafter's
    own argmax (`greedy_head_off`). Returns (A, n) tensors, the anchors' offsets and `whole` (A,): the anchors whose
    every block position lies in the response. `head=False` skips the head's decode (`greedy` is then the argmax's)."""
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
    mask = torch.as_tensor(row["loss_mask"], dtype=torch.bool)
    full = ids.shape[0]
    features = torch.as_tensor(row["features"])
    if features.dtype == torch.int16:
        features = features.view(torch.bfloat16)
    features = features.view(full, -1)
    topk_ids = torch.as_tensor(row["topk_ids"], dtype=torch.long).view(full, -1)
    topk_probs = torch.as_tensor(row["topk_probs"]).view(full, -1)
    n = xpress.config.block_size - 1
    response = mask.nonzero().flatten()
    first = int(response[0])
    anchors = [t for t in range(max(first, 1), full - 1) if mask[t + 1]]  # t in the response, as training and decoding
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    greedy, greedy_off, soft, whole = [], [], [], []
    for lo in range(0, len(anchors), chunk):
        a = torch.tensor(anchors[lo : lo + chunk])
        hidden = draft_blocks(xpress, embed, features[None], a[None], ids[a][None])[0]  # (m, B, H)
        logits = xpress.base_logits(hidden.to(lm_head.weight.dtype), lm_head).float()  # (m, n, V)
        q = logits.softmax(-1)
        pos = (a[:, None] + torch.arange(n)).clamp(max=full - 1)  # distribution of block position k lives at t+k
        valid = (a[:, None] + 1 + torch.arange(n)) < full
        valid &= mask[(a[:, None] + 1 + torch.arange(n)).clamp(max=full - 1)]
        p_ids, p_probs = topk_ids[pos], topk_probs[pos]  # (m, n, k)
        # 1 − TV ≥ Σ_{top-k} min(p, q): exact on the held entries, the tail counted as disjoint.
        overlap = torch.minimum(p_probs, torch.gather(q, -1, p_ids)).sum(-1)
        argmax = logits.argmax(-1)
        drafts = argmax
        if head:
            last = torch.stack([ids[a - 1], ids[a]], dim=-1)  # the token before each anchor and the anchor
            drafts = xpress.refine(hidden.to(lm_head.weight.dtype), logits, last).tokens  # greedy, as decoding drafts
        soft.append(overlap * valid)
        greedy.append(((drafts == p_ids[..., 0]) & valid).float())
        greedy_off.append(((argmax == p_ids[..., 0]) & valid).float())
        whole.append(valid.all(-1))
    return {
        "offsets": torch.tensor(anchors) - first,
        "soft": torch.cat(soft),
        "greedy": torch.cat(greedy),
        "greedy_head_off": torch.cat(greedy_off),
        "whole": torch.cat(whole),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--cache", required=True, help="a held-out signal cache (train_refiner --eval_held_out)")
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--positions", type=int, default=96, help="the decoded prefix compared with the whole response")
    parser.add_argument("--realized", type=int, default=0,
                        help="also decode the first N rows' prompts with spec_generate (greedy, as many new tokens as "
                        "the stored response) and compare the measured τ with the chained estimate of those rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_smollm2(torch.float32)
    xpress = XPressModel.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    rows = load_signal_cache(args.cache)
    per = {"uniform_soft": [], "uniform_greedy": [], "uniform_soft_prefix": [], "uniform_greedy_prefix": [],
           "uniform_greedy_head_off": []}
    tokens = steps = tokens_prefix = steps_prefix = tokens_off = steps_off = 0
    # accepted-so-far indicators of the blocks wholly in a response: at every anchor, and at the anchors each walk visits
    runs = {"greedy": [], "greedy_head_off": []}
    chained_runs = {"greedy": [], "greedy_head_off": []}
    realized = {"chained_tokens": 0, "chained_steps": 0, "tokens": 0, "steps": 0, "identical_rows": 0}
    for i in range(min(args.rows, len(rows))):
        acc = row_acceptance(xpress, target, rows[i])
        tau_soft = 1 + acc["soft"].cumprod(-1).sum(-1)
        tau_greedy = 1 + acc["greedy"].cumprod(-1).sum(-1)
        tau_off = 1 + acc["greedy_head_off"].cumprod(-1).sum(-1)
        prefix = acc["offsets"] < args.positions
        per["uniform_soft"] += tau_soft.tolist()
        per["uniform_greedy"] += tau_greedy.tolist()
        per["uniform_soft_prefix"] += tau_soft[prefix].tolist()
        per["uniform_greedy_prefix"] += tau_greedy[prefix].tolist()
        per["uniform_greedy_head_off"] += tau_off.tolist()
        row_tokens, row_steps, visited = chained(tau_greedy.tolist())
        tokens, steps = tokens + row_tokens, steps + row_steps
        t, s, visited_off = chained(tau_off.tolist())
        tokens_off, steps_off = tokens_off + t, steps_off + s
        for drafts, walk in (("greedy", visited), ("greedy_head_off", visited_off)):
            walk = torch.tensor(walk, dtype=torch.long)
            runs[drafts].append(acc[drafts][acc["whole"]].cumprod(-1))
            chained_runs[drafts].append(acc[drafts][walk[acc["whole"][walk]]].cumprod(-1))
        t, s, _ = chained(tau_greedy[prefix].tolist())
        tokens_prefix, steps_prefix = tokens_prefix + t, steps_prefix + s
        print(f"row {i}: {len(tau_greedy)} anchors, uniform greedy τ {tau_greedy.mean():.2f}, "
              f"chained {row_tokens / row_steps:.2f}")
        if i < args.realized:
            ids = torch.as_tensor(rows[i]["input_ids"])
            first = int(torch.as_tensor(rows[i]["loss_mask"]).bool().nonzero()[0])
            out = xpress.spec_generate(target, ids[None, :first], max_new_tokens=len(ids) - first)
            lengths = out.stats.acceptance_lengths
            realized["chained_tokens"] += row_tokens
            realized["chained_steps"] += row_steps
            realized["tokens"] += sum(lengths)
            realized["steps"] += len(lengths)
            realized["identical_rows"] += int(torch.equal(out.sequences[0, : len(ids)], ids))
            print(f"  decoded: τ {sum(lengths) / max(len(lengths), 1):.2f} over {len(lengths)} steps")
    mean = {k: sum(v) / len(v) for k, v in per.items()}
    # P(position k accepted | positions < k accepted), the factors greedy τ is made of, over the whole blocks: at every
    # anchor, and at the anchors decoding visits (each walk its own: the head's drafts, the drafter's argmax)
    def factors(blocks: list[torch.Tensor]) -> list[float]:
        run = torch.cat(blocks)
        reached = torch.cat([run.new_tensor([run.shape[0]]), run.sum(0)])  # blocks accepted up to k - 1, from k = 0
        return [round(v, 4) for v in (reached[1:7] / reached[:6]).tolist()]

    conditional = {name: factors(blocks) for name, blocks in runs.items()}
    conditional.update({f"{name}_chained": factors(blocks) for name, blocks in chained_runs.items()})
    harmonic = len(per["uniform_greedy"]) / sum(1 / x for x in per["uniform_greedy"])
    result = {
        "checkpoint": args.checkpoint,
        "cache": args.cache,
        "rows": min(args.rows, len(rows)),
        "anchors": len(per["uniform_soft"]),
        "prefix_positions": args.positions,
        "tau_T1_uniform_all": mean["uniform_soft"],
        "tau_T1_uniform_prefix": mean["uniform_soft_prefix"],
        "tau_greedy_uniform_all": mean["uniform_greedy"],
        "tau_greedy_uniform_prefix": mean["uniform_greedy_prefix"],
        "tau_greedy_harmonic_all": harmonic,
        "tau_greedy_chained_all": tokens / steps,
        "tau_greedy_chained_prefix": tokens_prefix / steps_prefix,
        "tau_greedy_uniform_all_head_off": mean["uniform_greedy_head_off"],
        "tau_greedy_chained_all_head_off": tokens_off / steps_off,
        "greedy_conditional_acceptance_k1_6": conditional["greedy"],
        "greedy_conditional_acceptance_k1_6_head_off": conditional["greedy_head_off"],
        "greedy_conditional_acceptance_k1_6_chained": conditional["greedy_chained"],
        "greedy_conditional_acceptance_k1_6_chained_head_off": conditional["greedy_head_off_chained"],
    }
    if args.realized:
        result["realized"] = {
            "rows": min(args.realized, result["rows"]),
            "tau_chained_estimate": realized["chained_tokens"] / realized["chained_steps"],
            "tau_decoded": realized["tokens"] / max(realized["steps"], 1),
            "rows_reproducing_the_stored_response": realized["identical_rows"],
        }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
