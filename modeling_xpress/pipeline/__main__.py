"""`python -m modeling_xpress.pipeline`: the pipeline's command (`modeling_xpress.pipeline`).

    python -m modeling_xpress.pipeline --target gemma3-270m --recipe gemma3-270m --out runs/gemma3-270m
    python -m modeling_xpress.pipeline --target path/to/model --recipe my-recipe.json --out runs/mine
    python -m modeling_xpress.pipeline --target smollm2-135m-instruct --recipe smollm2-v9-mined --out runs/v9 \
        --set precision=float32 --set signal_cache=false --stages drafter

Run it again with the same arguments to continue an interrupted run: finished stages are skipped, an unfinished one
resumes (response and cache shards, training checkpoints, measured prompts). `<out>/README.md` lists the stages and
`<out>/records/` holds each stage's record. `--set key=value` changes one recipe field (a JSON value); `--stages`
runs only the named stages of the recipe's plan (`--list` prints the plan).
"""

import argparse
import shlex
import sys

from .recipe import load_recipe, parse_override
from .stages import Pipeline, stage_plan
from .vllm_engine import DEFAULT_VLLM_PYTHON


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m modeling_xpress.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--target", required=True,
                        help="a model folder, a Hub repo id, or a GGUF package name (modeling_xpress.bench.assets."
                        "GGUF_PACKAGES: smollm2-135m-instruct, gemma3-270m)")
    parser.add_argument("--recipe", required=True, help="a recipe name in recipes/ or a recipe JSON file")
    parser.add_argument("--out", required=True, help="the output folder (the same one to continue a run)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="change a recipe field, e.g. --set precision=float32 --set signal_cache=false")
    parser.add_argument("--stages", nargs="+", help="run only these stages of the plan")
    parser.add_argument("--list", action="store_true", help="print the recipe and its stages, run nothing")
    parser.add_argument("--write-snapshots", action="store_true",
                        help="write each training stage's newest checkpoint to the recipe's snapshots folder, and stop")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON),
                        help="the Python of vLLM's virtualenv, for the responses (recipe engine auto or vllm)")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, dict(parse_override(item) for item in args.overrides))
    except ValueError as error:
        parser.error(str(error))
    command = shlex.join(["python", "-m", "modeling_xpress.pipeline", *(sys.argv[1:] if argv is None else argv)])
    pipeline = Pipeline(args.target, recipe, args.out, command=command, vllm_python=args.vllm_python,
                        recipe_name=args.recipe)  # fmt: skip
    if args.list:
        print(f"{recipe.description}\nstages: {' -> '.join(stage_plan(recipe))}")
        return
    if args.write_snapshots:
        pipeline.write_snapshots()
        return
    pipeline.run(args.stages)
    print(f"\ndone: {args.out}/README.md")


if __name__ == "__main__":
    main()
