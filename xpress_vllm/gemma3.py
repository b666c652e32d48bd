"""vLLM's Gemma-3 text model as a target that hands a dFlash drafter its intermediate hidden states.

vLLM's model runner asks every dFlash target for the hidden states of the drafter's `target_layer_ids`
(`_setup_eagle3_aux_hidden_state_outputs`): a target must implement `SupportsEagle3` and return
`(hidden_states, aux_hidden_states)` from its forward. vLLM 0.32's `Gemma3ForCausalLM` does not, so `register` puts
`Gemma3ForCausalLMWithAux` in its place for the architecture "Gemma3ForCausalLM" (Gemma-3 270M and 1B, text only).

Nothing of vLLM's model runs differently: its own forward runs the layers, and a forward pre-hook on each chosen
layer reads that layer's input. Aux layer k is the input of decoder layer k, i.e. the output of layer k - 1, which is
transformers' `output_hidden_states[k]` and what the drafter was trained on (vLLM asks for `target_layer_ids[i] + 1`).
vLLM's Gemma-3 layers pass the residual stream in two parts, `(hidden_states, residual)`, and add them in the next
layer's fused add-norm, in place: the pre-hook adds them itself, into a new tensor, before that norm runs. A model
served without a drafter has no aux layers, no hooks and returns what vLLM's class returns.
"""

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.interfaces import SupportsEagle3


class Gemma3ForCausalLMWithAux(Gemma3ForCausalLM, SupportsEagle3):
    """vLLM's `Gemma3ForCausalLM`, plus the hidden states of `aux_hidden_state_layers` for a dFlash drafter."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Read the input of decoder layer k, for each k in `layers` (0: the scaled embeddings), in every forward."""
        num_layers = len(self.model.layers)
        wanted = tuple(sorted(set(layers)))
        if any(not 0 <= k < num_layers for k in wanted):
            raise ValueError(
                f"aux hidden-state layers {wanted}: this Gemma-3 target has {num_layers} decoder layers, and a layer's "
                f"output is read at the next layer's input, so each must lie in 0..{num_layers - 1} (a dFlash "
                f"drafter's target_layer_ids in 0..{num_layers - 2}). Use a drafter trained on earlier layers."
            )
        if wanted and get_pp_group().world_size > 1:
            raise NotImplementedError(
                "xpress_vllm reads a Gemma-3 target's hidden states on one pipeline stage only: serve it with "
                "--pipeline-parallel-size 1."
            )
        for handle in getattr(self, "_aux_hooks", ()):
            handle.remove()
        self.aux_hidden_state_layers = wanted
        self._aux_hooks = [self.model.layers[k].register_forward_pre_hook(self._keep_layer_input) for k in wanted]
        self._aux_hidden_states: list[torch.Tensor] = []

    def _keep_layer_input(self, layer, args) -> None:
        # Gemma3Model calls each layer as layer(positions, hidden_states, residual); residual is None before layer 0.
        _, hidden_states, residual = args[:3]
        self._aux_hidden_states.append(hidden_states if residual is None else hidden_states + residual)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        """vLLM's forward; with aux layers set, `(hidden_states, [input of layer k for k in aux layers])`."""
        if not self.aux_hidden_state_layers:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        self._aux_hidden_states = []
        hidden_states = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        aux, self._aux_hidden_states = self._aux_hidden_states, []
        return hidden_states, aux


__all__ = ["Gemma3ForCausalLMWithAux"]
