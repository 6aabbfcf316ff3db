"""Toy processor: a PIL-backend image processor and a word-level tokenizer built offline."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, ProcessorMixin
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import PILImageResampling


class ToyMoeImageProcessor(PilBackend):
    resample = PILImageResampling.BILINEAR
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    size = {"height": 8, "width": 8}
    do_resize = True
    do_rescale = True
    do_normalize = True
    model_input_names = ["pixel_values"]


class ToyMoeProcessor(ProcessorMixin):
    def __init__(self, image_processor, tokenizer):
        super().__init__(image_processor, tokenizer)


WORDS = ["a", "photo", "of", "red", "green", "blue", "circle", "square", "cat", "dog"]


def make_toy_processor(config) -> ToyMoeProcessor:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    return ToyMoeProcessor(image_processor=ToyMoeImageProcessor(), tokenizer=tokenizer)
