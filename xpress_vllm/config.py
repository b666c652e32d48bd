"""The xPress config as vLLM reads it: `XPressConfig` plus the `dflash_config` vLLM's dFlash code looks up."""

from modeling_xpress.configuration_xpress import XPressConfig


class XPressVLLMConfig(XPressConfig):
    """`XPressConfig` with `dflash_config = {mask_token_id, target_layer_ids}`, the fields through which vLLM's
    dFlash proposer and model runner find the mask slot's input id and the target layers whose hidden states the
    drafter reads.

    A drafter that owns a learned mask vector (`mask_token_id=None`) gets `vocab_size` as its mask id: an id no
    token has, so a mask slot can never be confused with an anchor that happens to be the mask token
    (`model.XPressDFlashModel.embed_input_ids` swaps in the vector)."""

    def __post_init__(self, **kwargs):
        kwargs.pop("dflash_config", None)  # derived below, never read back
        super().__post_init__(**kwargs)
        mask_id = self.vocab_size if self.mask_token_id is None else self.mask_token_id
        self.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": list(self.target_layer_ids)}


__all__ = ["XPressVLLMConfig"]
