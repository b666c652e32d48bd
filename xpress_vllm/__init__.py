"""Serve an xPress checkpoint with vLLM: its drafter runs as vLLM's dFlash drafter, its correction head on every
proposal, batched over requests.

    vllm serve TARGET --speculative-config '{"method": "dflash", "model": "XPRESS_CHECKPOINT", "num_speculative_tokens": 3}'

vLLM finds this package through its `vllm.general_plugins` entry point (setup.cfg), which runs `register` in every
vLLM process. `register` teaches transformers the "xpress" config type (so no `--trust-remote-code` is needed) and
vLLM the drafter class of an xPress checkpoint; `proposer` puts the head into vLLM's dFlash proposer. Nothing here
forks vLLM; the parts of vLLM it builds on are checked against `SUPPORTED_VLLM` when a checkpoint is loaded.

This package imports vLLM, and vLLM only exists in its own virtualenv (`make vllm`): nothing in `modeling_xpress`
imports it.
"""

import logging

# vLLM releases the plugin was built and tested against (its dFlash proposer and drafter classes are internal API).
SUPPORTED_VLLM = ("0.32",)

logger = logging.getLogger(__name__)


def vllm_version_supported(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM)


def check_vllm_version() -> None:
    import vllm

    if not vllm_version_supported(vllm.__version__):
        raise RuntimeError(
            f"xpress_vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}, but vLLM {vllm.__version__} is "
            "installed. Install a supported release (`make vllm` builds .venv-vllm with one), or serve the xPress "
            "checkpoint with transformers (`target.generate(..., assistant_model=xpress)`)."
        )


def register() -> None:
    """The `vllm.general_plugins` entry point: safe to run more than once, in every vLLM process."""
    import vllm
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .config import XPressVLLMConfig

    try:
        AutoConfig.register("xpress", XPressVLLMConfig)
    except ValueError:  # already registered in this process
        pass
    # vLLM checks the checkpoint's architecture ("XPressModel", or a release folder's "Qwen3XPressModel") when it
    # reads the draft config, then builds the class it names "DFlash" + that architecture. All lead to one class.
    for arch in ("XPressModel", "DFlashXPressModel", "Qwen3XPressModel", "DFlashQwen3XPressModel"):
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, "xpress_vllm.model:XPressDFlashForCausalLM")
    if not vllm_version_supported(vllm.__version__):
        logger.warning("xpress_vllm: vLLM %s is not a supported release %s; xPress checkpoints will not load",
                       vllm.__version__, SUPPORTED_VLLM)  # fmt: skip
        return
    # vLLM's Gemma-3 text model gives a dFlash drafter no hidden states; this subclass does (xpress_vllm/gemma3.py).
    # It replaces vLLM's class for every Gemma-3 text target, and without a drafter it computes what vLLM's computes.
    ModelRegistry.register_model("Gemma3ForCausalLM", "xpress_vllm.gemma3:Gemma3ForCausalLMWithAux")
    from .fixes import install_cpu_fixes
    from .proposer import install_proposer

    install_cpu_fixes()
    install_proposer()


__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "register"]
