"""The main job: SmolLM2-135M-Instruct with the bundled xPress checkpoint, next to plain decoding, in one run.
`--target gemma` (`make demo TARGET=gemma`) runs the second bundled pair instead: Gemma-3-270M, a base model
continuing text, with its own checkpoint.

Fetches the target (`modeling_xpress.bench.assets`, cached after the first run), loads the bundled checkpoint with
`AutoModel.from_pretrained(..., trust_remote_code=True)` (the code inside the folder, as a Hub user would), greedy-
decodes a few prompts with `target.generate` alone, with `assistant_model=xpress`, and with
`xpress.spec_generate(target, ..., compile=True)` (static caches and `torch.compile`, compiled once before timing), and
prints each answer, whether it is token-for-token the target's own, τ, and the speed ratio against plain decoding
measured in this run.

    python examples/demo.py                       # fp32: the exactness setting
    python examples/demo.py --dtype bfloat16      # faster on CPUs with bf16 units; near-ties may flip (README)
    python examples/demo.py --constructed         # no download: a tiny constructed pair (see synthetic.py)
    python examples/demo.py --no-compile          # skip the compiled decoder (and its minute of compiling)
    python examples/demo.py --num-assistant-tokens 15  # whole blocks (the bundled checkpoint's block is 16)
    python examples/demo.py --held-out 10 --kinds task --max-new-tokens 96   # held-out training prompts instead
    python examples/demo.py --target gemma        # Gemma-3-270M (sliding-window layers, 262k vocabulary)

It calls both xPress decoders with their defaults: each verifies the number of drafts per block that pays on this
machine, the checkpoint's acceptance measured on held-out training prompts (`config.draft_acceptance`) against the
matrix products of its own loop timed here (`xpress.choose_draft_cap(target, compiled=...)`, printed before decoding);
`--num-assistant-tokens` fixes it for both.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModel

from modeling_xpress.bench.assets import DTYPES
from modeling_xpress.bench.demo import BUNDLED, BundledPair, bundled_pair, compare_greedy, summary
from modeling_xpress.training.prompts import GENERATORS


def real_pair(pair: BundledPair, dtype: torch.dtype, checkpoint: str, texts: list[str]):
    from modeling_xpress.bench.assets import load_gguf_target
    from modeling_xpress.bench.benchmark import prompt_ids

    if not (Path(checkpoint) / "config.json").is_file():
        raise SystemExit(f"no xPress checkpoint at {checkpoint}: pass --checkpoint <folder>, or run from a full clone "
                         "of the repository (the bundled ones live in checkpoints/)")  # fmt: skip
    target, tokenizer = load_gguf_target(pair.target, dtype=dtype)
    xpress = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, dtype=dtype).eval()
    return target, xpress, tokenizer, prompt_ids(tokenizer, texts, chat=pair.chat)


def constructed_pair(n_prompts: int):
    from modeling_xpress.training.synthetic import constructed_permutation_pair

    torch.manual_seed(0)
    target, xpress = constructed_permutation_pair()
    return target, xpress, None, [torch.randint(0, target.config.vocab_size, (1, 6)) for _ in range(n_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(BUNDLED), default="smollm2",
                        help="the bundled pair: SmolLM2-135M-Instruct (default) or Gemma-3-270M (a base model)")
    parser.add_argument("--checkpoint", default=None, help="xPress folder (default: the target's bundled one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the third decoder, xpress.spec_generate(target, ..., compile=True) (static caches "
                        "and torch.compile; it compiles once, about a minute on a CPU, before anything is timed)")
    parser.add_argument("--num-assistant-tokens", type=int, default=None,
                        help="drafts verified per block by both xPress decoders (default: each decoder's default, "
                        "chosen on this machine from the checkpoint's draft_acceptance)")
    parser.add_argument("--held-out", type=int, default=None, metavar="N",
                        help="decode the first N held-out training prompts (never trained on) instead of the demo's")
    parser.add_argument("--kinds", choices=sorted(GENERATORS), default=None,
                        help="which training prompt generator --held-out reads (default: the target's, task for "
                        "SmolLM2, completion for Gemma)")
    parser.add_argument("--constructed", action="store_true",
                        help="the offline example: a tiny target with a constructed (not trained) head")  # fmt: skip
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    pair = bundled_pair(args.target)
    texts = list(pair.prompts)
    if args.held_out:
        from modeling_xpress.training.regeneration import held_out_prompts

        texts = held_out_prompts(args.held_out, kinds=GENERATORS[args.kinds or pair.held_out_kinds])
    if args.constructed:
        target, xpress, tokenizer, prompts = constructed_pair(n_prompts=4)
    else:
        checkpoint = args.checkpoint or str(pair.checkpoint)
        target, xpress, tokenizer, prompts = real_pair(pair, DTYPES[args.dtype], checkpoint, texts)
    cap = args.num_assistant_tokens
    if cap is None and getattr(xpress.config, "draft_acceptance", None) is not None:
        for compiled in (False, *([] if args.no_compile else [True])):
            choice = xpress.choose_draft_cap(target, compiled=compiled)
            entry = "spec_generate(compile=True)" if compiled else "generate(assistant_model=xpress)"
            print(f"drafts per block for {entry}, chosen on this machine (the checkpoint's held-out acceptance "
                  f"against its loop's products timed here, {args.dtype}):\n{choice.table()}\n")  # fmt: skip
    elif cap is None:
        print(f"drafts verified per block: {xpress.config.num_assistant_tokens or 'the whole block'} (the config's)")
    # The compiled decoder drafts a tree where one pays on this machine (the checkpoint's measured tree acceptance
    # against the timed cost of verifying its nodes), else linear blocks.
    trees = "auto" if cap is None and getattr(xpress.config, "tree_acceptance", None) and not args.no_compile else None
    if trees:
        print("draft shape for spec_generate(compile=True, tree_nodes='auto'), chosen on this machine:\n"
              f"{xpress.choose_draft_shape(target, compiled=True).table()}\n")  # fmt: skip
    if not args.no_compile:
        print("compiling xpress.spec_generate(compile=True) once for these prompts (not timed) ...", flush=True)
    rows = compare_greedy(target, xpress, prompts, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer,
                          compiled=not args.no_compile, num_assistant_tokens=cap, tree_nodes=trees)  # fmt: skip
    for i, row in enumerate(rows):
        if row.text is not None:
            print(f"--- prompt {i}: {texts[i]}\n{row.text.strip()}\n")
        print(f"prompt {i}: {row.new_tokens} new tokens; generate(assistant_model=xpress): identical to the target's "
              f"greedy output {row.identical}, tau {row.mean_tau:.2f}, speed vs plain {row.speedup:.2f}x")  # fmt: skip
        if row.compiled_seconds is not None:
            seconds = row.compiled_compile_seconds
            recompiled = f" (it compiled for {seconds:.1f} s of it)" if seconds else ""
            print(f"          spec_generate(compile=True): identical {row.compiled_identical}, tau "
                  f"{row.compiled_tau:.2f}, speed vs plain {row.compiled_speedup:.2f}x{recompiled}")  # fmt: skip
        print()
    s = summary(rows)
    setting = f"{torch.get_num_threads()} threads, {args.dtype if not args.constructed else 'float32'}"
    print(f"target.generate(assistant_model=xpress): {s['identical']}/{s['prompts']} outputs identical to the target's "
          f"greedy decode; mean tau {s['mean_tau']:.2f}; {s['xpress_tokens_per_s']:.1f} vs "
          f"{s['plain_tokens_per_s']:.1f} tokens/s: speed ratio vs plain target.generate measured in this run "
          f"{s['speedup_vs_plain']:.2f}x ({setting})")  # fmt: skip
    if "compiled_speedup_vs_plain" in s:
        print(f"xpress.spec_generate(target, ..., compile=True): {s['compiled_identical']}/{s['prompts']} identical; "
              f"mean tau {s['compiled_mean_tau']:.2f}; {s['compiled_tokens_per_s']:.1f} tokens/s: speed ratio vs plain "
              f"target.generate measured in this run {s['compiled_speedup_vs_plain']:.2f}x ({setting})")  # fmt: skip


if __name__ == "__main__":
    main()
