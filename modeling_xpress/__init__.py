"""xPress for Hugging Face: a causal refiner on a block-diffusion (dFlash) drafter for lossless speculative decoding.

    from modeling_xpress import XPressConfig, XPressModel
    xpress = XPressModel(XPressConfig.from_target_config(target.config, num_hidden_layers=2))
    out = target.generate(**inputs, assistant_model=xpress)
"""

from .configuration_xpress import XPressConfig, default_target_layer_ids
from .decoding import XPressGenerateOutput, spec_generate
from .generation import XPressCandidateGenerator, install_generation_hook
from .modeling_xpress import MarkovHead, XPressModel, XPressPreTrainedModel, XPressRefiner
from .refinement import RefinementResult, jacobi_refine, plain_decode, sequential_refine
from .stats import XPressGenerationStats

__version__ = "0.1.0"

__all__ = [
    "XPressConfig",
    "XPressModel",
    "XPressPreTrainedModel",
    "XPressRefiner",
    "MarkovHead",
    "XPressCandidateGenerator",
    "XPressGenerationStats",
    "XPressGenerateOutput",
    "RefinementResult",
    "default_target_layer_ids",
    "install_generation_hook",
    "jacobi_refine",
    "plain_decode",
    "sequential_refine",
    "spec_generate",
]
