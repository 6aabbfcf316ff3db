"""Processor for OmniMoE-VL (spec omnimoe_vl.md §6): ChatML prompts for Qwen3 with one SigLIP image per prompt.

A conversation is rendered by the chat template (plain ChatML, no Qwen3 thinking blocks, the image first in the user
turn):

    <|im_start|>system\n{system}<|im_end|>\n                    (only with a system message)
    <|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\n{question}<|im_end|>\n
    <|im_start|>assistant\n{answer}<|im_end|>\n

and the single `<|image_pad|>` becomes `num_image_tokens` of them (one per patch: the fused tokens replace them in
the model), by `ProcessorMixin.__call__` through `replace_image_token`.

**Outputs** (`BatchFeature`): `input_ids` and `attention_mask` (left-padded by default, for batched generation),
`pixel_values` `(num_images, 3, H, W)`, `prompt_mask` (1 on the question tokens of the user turn that holds the
image: what conditions the model's depth route) and, with `return_labels=True` for training collators, `labels`
(-100 everywhere but the assistant answers and their `<|im_end|>`). Both masks are found from the tokens, so they
also work on text rendered beforehand; a prompt written without ChatML turns is one user question.

Images go through transformers' `SiglipImageProcessorPil` (squash to the tower's size, bicubic, mean = std = 0.5),
which needs no torchvision.

This file is copied as is into exported Hub folders, where moezoo is not installed: besides the standard library,
numpy and transformers it imports only from `inputs.py`, which is copied beside it.
"""

import numpy as np
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import ImageInput
from transformers.processing_utils import MultiModalData, ProcessingKwargs, Unpack
from transformers.tokenization_utils_base import PreTokenizedInput, TextInput

from .inputs import ChecksInputs
from .qwen_tokens import IM_END, IM_START, IMAGE_TOKEN, VISION_END, VISION_START

IGNORE_INDEX = -100  # what transformers' losses skip

# Newlines are Jinja expressions (`{{ '\n' }}`): the tags' whitespace control (`{%-`) would strip literal ones.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for item in message['content'] if item['type'] == 'image' -%}"
    "<|vision_start|><|image_pad|><|vision_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


class OmniMoeVlProcessorKwargs(ProcessingKwargs, total=False):
    r"""
    return_labels (`bool`, *optional*, defaults to `False`):
        Whether to return `labels` for training: the assistant answers and their `<|im_end|>`, -100 elsewhere.
    """

    return_labels: bool


class OmniMoeVlProcessor(ChecksInputs):
    r"""
    The SigLIP image processor and the Qwen3 tokenizer of an OmniMoE-VL model (see the module docstring).

    Args:
        image_processor (`SiglipImageProcessorPil`): resizes to the vision tower's input size.
        tokenizer (`Qwen2Tokenizer`): Qwen3's tokenizer, which holds `<|image_pad|>`, `<|vision_start|>`,
            `<|vision_end|>`, `<|im_start|>` and `<|im_end|>`.
        chat_template (`str`, *optional*): defaults to the ChatML template above.
        num_image_tokens (`int`, *optional*, defaults to 576): placeholders per image, the config's
            `num_image_tokens` ((image_size / patch_size)²).
    """

    valid_processor_kwargs = OmniMoeVlProcessorKwargs
    # Left padding keeps every prompt's last token at the end of its row, where generation continues.
    text_kwargs = {"padding_side": "left"}
    return_labels = False

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, num_image_tokens=576, **kwargs):
        self.num_image_tokens = num_image_tokens
        self.image_token = IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        super().__init__(image_processor, tokenizer, chat_template=chat_template or CHAT_TEMPLATE, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "pixel_values", "prompt_mask"]

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        # Only the pad is expanded: the template already wraps it in <|vision_start|> ... <|vision_end|>.
        return IMAGE_TOKEN * self.num_image_tokens

    def _get_num_multimodal_tokens(self, image_sizes=None, **kwargs) -> MultiModalData:
        """
        The number of placeholder tokens each image of `image_sizes` ((height, width) pairs) becomes: always
        `num_image_tokens`, since every image is resized to the vision tower's fixed size (as LLaVA's processor).
        """
        vision_data = {}
        if image_sizes is not None:
            vision_data["num_image_tokens"] = [self.num_image_tokens] * len(image_sizes)
            vision_data["num_image_patches"] = [1] * len(image_sizes)
        return MultiModalData(**vision_data)

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        if videos is not None or audio is not None:
            raise ValueError("OmniMoE-VL takes images and text only; it has no video or audio input")
        super().validate_inputs(images=images, text=text, **kwargs)
        if text is None:
            return
        # The model takes one image per prompt and says so; the processor formats any number, as transformers'
        # processors do, so that it also serves conversations checked elsewhere (chat templates, assistant masks).
        for index, sample in enumerate(text):
            # A prompt without ChatML turns is one user question (see `_turns`).
            if IMAGE_TOKEN in sample and IM_START in sample and not _has_image_turn(sample):
                raise ValueError(
                    f"text {index} has its {IMAGE_TOKEN} outside a user turn ({IM_START}user ... {IM_END}); render "
                    "the prompt with `processor.apply_chat_template(messages)`, whose user turn holds the image"
                )

    def __call__(
        self,
        images: ImageInput | None = None,
        text: TextInput | PreTokenizedInput | list[TextInput] | list[PreTokenizedInput] | None = None,
        **kwargs: Unpack[OmniMoeVlProcessorKwargs],
    ) -> BatchFeature:
        r"""
        Tokenize `text` (chat-template renderings, one `<|image_pad|>` per image) and prepare `images`, one per text
        with an image. `return_labels=True` adds `labels` for training (the assistant answers only).
        """
        return_labels = kwargs.pop("return_labels", self.return_labels)
        inputs = super().__call__(images=images, text=text, **kwargs)
        if "input_ids" in inputs:
            special = self._turn_token_ids()
            rows = [np.asarray(row).tolist() for row in inputs["input_ids"]]
            inputs["prompt_mask"] = [self._prompt_mask(row, special) for row in rows]
            if return_labels:
                inputs["labels"] = [self._labels(row, special) for row in rows]
        # The masks join the other outputs in the tensor type asked for, flat or in `text_kwargs` or `common_kwargs`.
        text_kwargs = self._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs)["text_kwargs"]
        return BatchFeature(
            dict(inputs),
            tensor_type=text_kwargs.get("return_tensors"),
            skip_tensor_conversion=self.skip_tensor_conversion,
        )

    def _turn_token_ids(self) -> dict:
        tokenizer = self.tokenizer
        return {
            "im_start": tokenizer.convert_tokens_to_ids(IM_START),
            "im_end": tokenizer.convert_tokens_to_ids(IM_END),
            # What marks the image's turn: the template's <|vision_start|>, or the bare placeholder of a hand-written
            # prompt (which `validate_inputs` accepts inside a user turn).
            "image": {tokenizer.convert_tokens_to_ids(VISION_START), self.image_token_id},
            "special": set(tokenizer.all_special_ids) | {self.image_token_id},
        }

    def _turns(self, row: list[int], special: dict):
        """(role, first content position, end position) of every `<|im_start|>role ... <|im_end|>` turn of `row`,
        the end being the `<|im_end|>` (or the row's end for an unfinished turn, such as the generation prompt); a
        row without turns is one user turn."""
        starts = [i for i, token in enumerate(row) if token == special["im_start"]]
        if not starts:
            # A prompt written without ChatML turns (`"<|image_pad|>what is it?"`) is one user question, as the
            # plain prompts of transformers' image-text processors are.
            yield "user", 0, len(row)
        for start in starts:
            end = next((i for i in range(start + 1, len(row)) if row[i] == special["im_end"]), len(row))
            role = self.tokenizer.decode(row[start + 1 : start + 2]).strip()
            content = start + 2
            # The newline after the role belongs to the header.
            while content < end and self._is_blank(row[content]):
                content += 1
            yield role, content, end

    def _is_blank(self, token: int) -> bool:
        return not self.tokenizer.decode([token]).strip()

    def _prompt_mask(self, row: list[int], special: dict) -> list[int]:
        """1 on the question of the first user turn that holds the image: its tokens but the special, image and
        whitespace-only ones (spec §6, the token-based rule)."""
        mask = [0] * len(row)
        for role, content, end in self._turns(row, special):
            if role == "user" and not special["image"].isdisjoint(row[content:end]):
                for i in range(content, end):
                    if row[i] not in special["special"] and not self._is_blank(row[i]):
                        mask[i] = 1
                break
        return mask

    def _labels(self, row: list[int], special: dict) -> list[int]:
        """The token ids of every assistant answer and its `<|im_end|>`, -100 elsewhere (prompts, padding)."""
        labels = [IGNORE_INDEX] * len(row)
        for role, content, end in self._turns(row, special):
            if role == "assistant":
                for i in range(content, min(end + 1, len(row))):
                    labels[i] = row[i]
        return labels


def _has_image_turn(text: str) -> bool:
    """Whether a user turn of a rendered prompt holds the image placeholder."""
    return any(
        turn.startswith("user") and IMAGE_TOKEN in turn.split(IM_END)[0] for turn in text.split(IM_START)[1:]
    )


__all__ = ["OmniMoeVlProcessor"]
