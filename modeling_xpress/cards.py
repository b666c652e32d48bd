"""Model cards for saved xPress folders, rendered with huggingface_hub's card tools from `hub_cards/`.

The template is package data (`modeling_xpress/hub_cards/`), so a wheel install renders cards too. Not shipped
inside checkpoints: a model loaded with trust_remote_code alone keeps its folder's existing card.
"""

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

TEMPLATE = Path(__file__).resolve().parent / "hub_cards" / "xpress_model_card.md"

_REFINERS = {
    "xpress": "causal low-rank refiner solved by parallel Jacobi iterations (xPress)",
    "markov": "Markov head that biases each position by the previous token (DSpark baseline)",
    "none": "no correction head (plain dFlash drafter)",
}

# The config fields the card template shows under their own names.
_CARD_CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "block_size",
                       "target_layer_ids", "num_target_layers", "refiner", "refiner_rank", "jacobi_max_iters",
                       "jacobi_early_exit")


def results_markdown(results: list[dict] | None) -> str:
    """A Markdown table from evaluation rows ({"dataset", "temperature", "method", "tau", ...})."""
    if not results:
        return "No evaluation results were recorded with this checkpoint."
    columns = list(dict.fromkeys(key for row in results for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else "–" if row.get(c, "") is None
                 else str(row.get(c, "")) for c in columns]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hub_repo_id(name: str) -> str | None:
    """`name` if it reads as a Hub repo id ("org/name"), None for a local path (card metadata wants repo ids)."""
    if "/" not in name or Path(name).exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def render_model_card(
    config,
    *,
    results: list[dict] | None = None,
    repo_id: str = "<your-org>/<this-repo>",
    target_model: str | None = None,
    training_summary: str = "See the project README for the training recipe.",
    evaluation_summary: str = "",
    chat: bool = True,
    template: Path = TEMPLATE,
) -> ModelCard:
    """Fill `hub_cards/xpress_model_card.md` from an `XPressConfig` and optional evaluation rows.

    `repo_id` is the name the card loads the checkpoint by (a Hub repo id, or the saved folder's name).
    `target_model` defaults to `config.target_model_name` (set by `XPressConfig.from_target_config`).
    `evaluation_summary` (Markdown) goes above the results table: how and where the numbers were measured.
    `chat`: the target is a chat model (the example prompt goes through its chat template), else a base model (plain
    text to continue).
    """
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found; reinstall the modeling_xpress package")
    target = target_model or getattr(config, "target_model_name", None) or "the target model"
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", "xpress", "dflash", "block-diffusion"],
        base_model=_hub_repo_id(target),
    )
    mask = "learned vector" if config.mask_token_id is None else f"target token id {config.mask_token_id}"
    return ModelCard.from_template(
        card_data,
        template_path=str(template),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        target_model=target,
        num_draft_tokens=config.block_size - 1,
        refiner_description=_REFINERS[config.refiner],
        mask_description=mask,
        **{field: getattr(config, field) for field in _CARD_CONFIG_FIELDS},
        results_table=results_markdown(results),
        evaluation_summary=evaluation_summary,
        training_summary=training_summary,
        inputs_code=(
            'tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,\n'
            '                                       return_tensors="pt", return_dict=True)' if chat else
            'tokenizer("def fibonacci(n):", return_tensors="pt")  # a base model: text to continue'
        ),
    )
