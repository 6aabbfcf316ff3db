"""Processor of SMoES Qwen3.5-MoE models: transformers' `Qwen3VLProcessor` for images and text.

A Qwen3.5-MoE checkpoint ships `Qwen3VLProcessor`, whose video part (`Qwen3VLVideoProcessor`) needs torchvision.
SMoES changes nothing in the inputs, so this is that processor with its image processor and tokenizer only: the same
prompt expansion (`<|image_pad|>` x t*h*w / merge^2), `mm_token_type_ids` (0 text, 1 image), which SMoES reads as the
tokens' hard modality, and `pixel_values` / `image_grid_thw`. Videos need transformers' own processor, with torchvision.

This file is copied as is into exported Hub folders, where moezoo is not installed: it imports transformers only.
"""

from transformers import Qwen3VLProcessor


class SmoesQwen3_5MoeProcessor(Qwen3VLProcessor):
    r"""
    `Qwen3VLProcessor` without a video processor (see the module docstring).

    Args:
        image_processor ([`Qwen2VLImageProcessorPil`]): the Qwen2-VL image processor (PIL backend) with the vision
            tower's `patch_size`, `temporal_patch_size` and `merge_size`.
        tokenizer ([`PreTrainedTokenizerBase`]): Qwen3.5's tokenizer, which knows `<|image_pad|>`, `<|video_pad|>`,
            `<|vision_start|>` and `<|vision_end|>`.
        chat_template (`str`, *optional*): the Jinja template of `apply_chat_template`.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    @property
    def videos_kwargs(self):
        # `Qwen3VLProcessor` asks its video processor for frame metadata by default (`videos_kwargs`); without a video
        # processor there is no video default to give, and transformers merges `getattr(self, "videos_kwargs", {})`.
        raise AttributeError(f"{type(self).__name__} has no video processor, hence no default `videos_kwargs`")
