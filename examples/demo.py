"""The main job: SmolLM2-135M-Instruct with the bundled xPress checkpoint, next to plain decoding, in one run.

Fetches the target (`modeling_xpress.assets`, cached after the first run), loads the bundled checkpoint with
`AutoModel.from_pretrained(..., trust_remote_code=True)` (the code inside the folder, as a Hub user would), greedy-
decodes a few prompts with `target.generate` alone and with `assistant_model=xpress`, and prints each answer, whether
it is token-for-token the target's own, τ, and the speed ratio against plain decoding measured in this run.

    python examples/demo.py                       # fp32: the exactness setting
    python examples/demo.py --dtype bfloat16      # faster on CPUs with bf16 units; near-ties may flip (README)
    python examples/demo.py --constructed         # no download: a tiny constructed pair (see synthetic.py)
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModel

from modeling_xpress.assets import DTYPES
from modeling_xpress.demo import BUNDLED_CHECKPOINT, DEMO_PROMPTS, compare_greedy, summary


def smollm2_pair(dtype: torch.dtype, checkpoint: str):
    from modeling_xpress.assets import load_smollm2
    from modeling_xpress.benchmark import chat_prompt_ids

    if not (Path(checkpoint) / "config.json").is_file():
        raise SystemExit(f"no xPress checkpoint at {checkpoint}: pass --checkpoint <folder>, or run from a full clone "
                         "of the repository (the bundled one lives in checkpoints/)")  # fmt: skip
    target, tokenizer = load_smollm2(dtype=dtype)
    xpress = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, dtype=dtype).eval()
    return target, xpress, tokenizer, chat_prompt_ids(tokenizer, DEMO_PROMPTS)


def constructed_pair(n_prompts: int):
    from modeling_xpress.synthetic import constructed_permutation_pair

    torch.manual_seed(0)
    target, xpress = constructed_permutation_pair()
    return target, xpress, None, [torch.randint(0, target.config.vocab_size, (1, 6)) for _ in range(n_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(BUNDLED_CHECKPOINT), help="xPress folder (default: bundled)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--constructed", action="store_true",
                        help="the offline example: a tiny target with a constructed (not trained) head")  # fmt: skip
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    if args.constructed:
        target, xpress, tokenizer, prompts = constructed_pair(n_prompts=4)
    else:
        target, xpress, tokenizer, prompts = smollm2_pair(DTYPES[args.dtype], args.checkpoint)
    rows = compare_greedy(target, xpress, prompts, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer)
    for i, row in enumerate(rows):
        if row.text is not None:
            print(f"--- prompt {i}: {DEMO_PROMPTS[i]}\n{row.text.strip()}\n")
        print(f"prompt {i}: {row.new_tokens} new tokens, identical to the target's greedy output: {row.identical}, "
              f"tau {row.mean_tau:.2f}, speed vs plain {row.speedup:.2f}x\n")  # fmt: skip
    s = summary(rows)
    print(f"{s['identical']}/{s['prompts']} outputs identical to the target's greedy decode; mean tau "
          f"{s['mean_tau']:.2f}; {s['xpress_tokens_per_s']:.1f} vs {s['plain_tokens_per_s']:.1f} tokens/s: speed "
          f"ratio vs plain target.generate measured in this run {s['speedup_vs_plain']:.2f}x "
          f"({torch.get_num_threads()} threads, {args.dtype if not args.constructed else 'float32'})")  # fmt: skip


if __name__ == "__main__":
    main()
