"""Files a saved xPress folder carries besides config, weights and code: the `custom_generate` recipe and the card.

This file travels with every saved checkpoint; it imports only the standard library, transformers and its
siblings. The model card is rendered by `modeling_xpress.cards` (huggingface_hub's card tools) when the package is
installed; a model loaded with trust_remote_code alone keeps the card its folder already had.
"""

from pathlib import Path

from transformers.utils import logging

logger = logging.get_logger(__name__)

RECIPE = Path("custom_generate") / "generate.py"


def _recipe_template(model) -> str | None:
    """The recipe shipped beside this file, or (for a trust_remote_code copy) the one in the folder it came from."""
    for candidate in (Path(__file__).parent / RECIPE, Path(model.config._name_or_path or ".") / RECIPE):
        if candidate.is_file():
            return candidate.read_text()
    return None


def write_hub_extras(model, folder: Path, repo_id: str | None = None) -> None:
    """Write `custom_generate/generate.py` and the model card `README.md` (naming `repo_id`, else the folder).

    The recipe is copied as is: it finds the folder or repo it runs from at call time, so the folder can be moved or
    pushed to the Hub.
    """
    template = _recipe_template(model)
    if template is None:
        logger.warning("custom_generate/generate.py template not found; the saved folder will not carry the recipe")
    else:
        recipe = folder / RECIPE
        recipe.parent.mkdir(parents=True, exist_ok=True)
        recipe.write_text(template)
    try:
        from modeling_xpress.cards import render_model_card
    except ImportError:
        return
    card = render_model_card(
        model.config, results=getattr(model, "evaluation_results", None), repo_id=repo_id or folder.resolve().name
    )
    card.save(folder / "README.md")
