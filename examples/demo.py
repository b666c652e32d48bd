"""The main job: xPress speculative decoding next to plain decoding, measured in the same run.

Until the trained SmolLM2 checkpoint is bundled, this builds its own small example: a tiny target whose next token
is a fixed permutation of the current one, and an xPress head *constructed* (not trained) to know that permutation,
so whole blocks are accepted. It shows exactness, τ and the measured speed ratio; on a model this small the ratio
says little about real models (the target forward is nearly free).
"""

import argparse

import torch

from modeling_xpress.demo import compare_greedy, summary
from modeling_xpress.synthetic import constructed_permutation_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    target, xpress = constructed_permutation_pair()
    prompts = [torch.randint(0, target.config.vocab_size, (1, 6)) for _ in range(args.prompts)]
    rows = compare_greedy(target, xpress, prompts, max_new_tokens=args.max_new_tokens)
    for i, row in enumerate(rows):
        print(f"prompt {i}: {row.new_tokens} new tokens, identical to target greedy: {row.identical}, "
              f"tau {row.mean_tau:.2f}, speedup {row.speedup:.2f}x")  # fmt: skip
    s = summary(rows)
    print(f"\n{s['identical']}/{s['prompts']} outputs identical to the target's greedy decode; mean tau "
          f"{s['mean_tau']:.2f}; speed ratio vs plain target.generate measured in this run: {s['speedup_vs_plain']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
