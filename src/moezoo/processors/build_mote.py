"""Assembling MoTE processors for presets (`moezoo create`) and tests, offline (not exported: exported folders carry
the processor files).

A preset with a tiny vocabulary gets a word-level tokenizer built here, deterministically: the config's special ids
(image and frame placeholders, begin/end of text, padding) hold their tokens, and the words of the chat template, of
the task prompts and of moezoo's synthetic data fill the rest. A paper-scale preset gets the real tokenizer of its
base model from the Hub.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

from ..hub.sources import TOKENIZER_FILES, locate
from .mote import (
    COIN_TASK_PROMPTS,
    GLM_CHAT_TEMPLATE,
    GLM_OCR_PROMPTS,
    SINGLE_STEP_PROMPTS,
    VIDEOLLM_SYSTEM_PROMPT,
    GlmOcrMoteProcessor,
    VideoLlmMoteFrameProcessor,
    VideoLlmMoteProcessor,
    kie_prompt,
)


LARGEST_TINY_VOCABULARY = 1000
LLAMA_TOKENIZER_REPO = "meta-llama/Llama-3.2-1B-Instruct"
GLM_OCR_TOKENIZER_REPO = "zai-org/GLM-OCR"
UNK_TOKEN = "<|unk|>"
PAD_TOKEN = "<|pad|>"
# Llama-3's names, so that tiny and real prompts read the same.
LLAMA_BOS, LLAMA_EOS = "<|begin_of_text|>", "<|eot_id|>"
GLM_CHAT_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")
# GLM-OCR's image processor limits, in merged tokens (28 x 28 pixels for GLM-OCR): shortest_edge 12,544 and
# longest_edge 9,633,792 pixels over its 2 temporal frames.
GLM_MIN_MERGED_TOKENS, GLM_MAX_MERGED_TOKENS = 8, 6144
# Answer numbering of procedure forecasting ("1. Stir.") up to VideoLLM-online's 5 future steps.
DIGITS = tuple(str(number) for number in range(1, 6))


def word_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Words between spaces, every punctuation character a word of its own ("Recognition:" -> "recognition", ":")."""
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")])


def words_of(*texts: str) -> list[str]:
    """The distinct lower-cased words of `texts`, in order of appearance, as the tiny tokenizers split them."""
    splitter = word_pre_tokenizer()
    words = [word for text in texts for word, _ in splitter.pre_tokenize_str(text.lower())]
    return list(dict.fromkeys(words))


def build_word_level_tokenizer(
    vocab_size: int,
    placed: dict[int, str],
    special_tokens: list[str],
    words: list[str],
    model_max_length: int,
    **named_special_tokens: str,
) -> PreTrainedTokenizerFast:
    """
    A lower-casing word-level tokenizer of exactly `vocab_size` tokens, built without downloads.

    Args:
        vocab_size: The model's vocabulary size.
        placed: Tokens at fixed ids (the config's special ids, or a frame separator such as ","), special or not.
        special_tokens: Tokens that are never split or lower-cased; those not `placed` take the lowest free ids.
        words: Fill the remaining ids in order until the vocabulary is full; later words become `<|unk|>`. Ids left
            over hold unused special tokens.
        model_max_length: The context length.
        named_special_tokens: `bos_token`, `eos_token`, `pad_token`, ... as for any transformers tokenizer.
    """
    vocab = {token: index for index, token in placed.items()}
    if len(vocab) != len(placed) or any(not 0 <= index < vocab_size for index in placed):
        raise ValueError(f"The placed tokens {placed} must be distinct, with ids below vocab_size={vocab_size}.")
    specials = list(dict.fromkeys([UNK_TOKEN, *special_tokens, *named_special_tokens.values()]))
    free_ids = iter(index for index in range(vocab_size) if index not in placed)
    for token in specials + [word for word in words if word not in specials]:
        if token in vocab:
            continue
        index = next(free_ids, None)
        if index is None:
            if token in specials:
                raise ValueError(f"vocab_size={vocab_size} leaves no id for the special token {token!r}.")
            break
        vocab[token] = index
    for index in free_ids:
        vocab[f"<|unused_{index}|>"] = index
        specials.append(f"<|unused_{index}|>")

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = word_pre_tokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, none before punctuation
    named = set(named_special_tokens.values())
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[token for token in specials if token not in named and token != UNK_TOKEN],
        model_max_length=model_max_length,
        **named_special_tokens,
    )


def _first_id(token_ids) -> int:
    return token_ids[0] if isinstance(token_ids, (list, tuple)) else token_ids


def _load_tokenizer(repo: str):
    """A paper-scale model's tokenizer from the Hub (see `moezoo.hub.sources.locate`)."""
    return AutoTokenizer.from_pretrained(locate(repo, "the tokenizer", allow_patterns=TOKENIZER_FILES))


# --- VideoLLM-MoTE and the text-only LlamaMote -----------------------------------------------------------------------


def task_prompt_words() -> list[str]:
    templates = [*COIN_TASK_PROMPTS.values(), *SINGLE_STEP_PROMPTS.values()]
    return words_of(VIDEOLLM_SYSTEM_PROMPT, *(template.format(num_steps="", goal="") for template in templates))


def make_llama_mote_tokenizer(config, words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The tokenizer of a text-only `LlamaMoteConfig`: built offline with Llama-3's special tokens at the config's
    bos/eos ids for a tiny vocabulary, Llama-3.2-Instruct's otherwise."""
    if config.vocab_size > LARGEST_TINY_VOCABULARY:
        return _load_tokenizer(LLAMA_TOKENIZER_REPO)
    placed = {config.bos_token_id: LLAMA_BOS, _first_id(config.eos_token_id): LLAMA_EOS}
    if config.pad_token_id is not None:
        placed[config.pad_token_id] = PAD_TOKEN
    vocabulary = words_of("User: Assistant: [ ] .", *words) + list(DIGITS) + task_prompt_words()
    return build_word_level_tokenizer(
        config.vocab_size, placed, [], vocabulary, config.max_position_embeddings, bos_token=LLAMA_BOS,
        eos_token=LLAMA_EOS, **({"pad_token": PAD_TOKEN} if config.pad_token_id is not None else {}),
    )  # fmt: skip


def build_tiny_videollm_tokenizer(config, words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """
    The tokenizer of a tiny VideoLLM-MoTE config: Llama-3's special tokens at the config's ids (`<|begin_of_text|>`
    at bos, `<|eot_id|>` at eos), `video_token` at `video_token_id` and "," at `frame_token_interval_id`, then the
    words of the A.5 template and prompts and `words` (a data set's labels).
    """
    text_config = config.text_config
    placed = {
        text_config.bos_token_id: LLAMA_BOS,
        _first_id(text_config.eos_token_id): LLAMA_EOS,
        config.video_token_id: config.video_token,
        config.frame_token_interval_id: ",",
    }
    if text_config.pad_token_id is not None:
        placed[text_config.pad_token_id] = PAD_TOKEN
    # Template words first, then the data's, so that neither is crowded out of a small vocabulary by the prompts.
    vocabulary = words_of("User: Assistant: [ ] .", *words) + list(DIGITS) + task_prompt_words()
    return build_word_level_tokenizer(
        text_config.vocab_size, placed, [config.video_token], vocabulary, text_config.max_position_embeddings,
        bos_token=LLAMA_BOS, eos_token=LLAMA_EOS,
        **({"pad_token": PAD_TOKEN} if text_config.pad_token_id is not None else {}),
    )  # fmt: skip


def make_videollm_mote_processor(config, tokenizer=None, words: tuple[str, ...] = ()) -> VideoLlmMoteProcessor:
    """
    The VideoLLM-MoTE processor of `config`: frames at `frame_fps`, at most `max_num_frames`, letterboxed to
    `frame_resolution`; the placeholder `video_token` and the frame separator `frame_token_interval_id`; the routes of
    `text_config.mote_expert_names`. Without `tokenizer`, a tiny vocabulary gets one built offline (with
    `words`, e.g. a data set's labels) and a real one Llama-3.2-Instruct's.
    """
    if tokenizer is None:
        if config.text_config.vocab_size <= LARGEST_TINY_VOCABULARY:
            tokenizer = build_tiny_videollm_tokenizer(config, words)
        else:
            tokenizer = _load_tokenizer(LLAMA_TOKENIZER_REPO)
    if tokenizer.convert_tokens_to_ids(config.video_token) != config.video_token_id:
        raise ValueError(
            f"The tokenizer maps the video token {config.video_token!r} to "
            f"{tokenizer.convert_tokens_to_ids(config.video_token)}, the config says video_token_id="
            f"{config.video_token_id}: use the tokenizer the model was built with."
        )
    frame_processor = VideoLlmMoteFrameProcessor(
        fps=config.frame_fps, max_num_frames=config.max_num_frames, size=config.frame_resolution
    )
    return VideoLlmMoteProcessor(
        frame_processor,
        tokenizer,
        expert_names=config.text_config.mote_expert_names,
        video_token=config.video_token,
        frame_interval_token=tokenizer.convert_ids_to_tokens(config.frame_token_interval_id),
        frame_num_tokens=config.frame_num_tokens,
    )


# --- GLM-OCR-MoTE ---------------------------------------------------------------------------------------------------


def build_tiny_glm_ocr_tokenizer(config, words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """
    The tokenizer of a tiny GLM-OCR-MoTE config: GLM's image and video tokens at the config's ids, `<|endoftext|>`
    and `<|user|>` at the two eos ids (GLM-OCR stops on both), then the chat markers, `words`, and the words of the
    OCR and KIE prompts.
    """
    text_config = config.text_config
    eos_ids = list(text_config.eos_token_id) if isinstance(text_config.eos_token_id, (list, tuple)) else [
        text_config.eos_token_id]
    placed = {
        config.image_token_id: "<|image|>",
        config.video_token_id: "<|video|>",
        config.image_start_token_id: "<|begin_of_image|>",
        config.image_end_token_id: "<|end_of_image|>",
        config.video_start_token_id: "<|begin_of_video|>",
        config.video_end_token_id: "<|end_of_video|>",
        **dict(zip(eos_ids, ("<|endoftext|>", "<|user|>"))),
    }
    named = {"eos_token": "<|endoftext|>"}
    if text_config.pad_token_id is not None:
        placed.setdefault(text_config.pad_token_id, PAD_TOKEN)
        named["pad_token"] = placed[text_config.pad_token_id]
    special = [*placed.values(), *GLM_CHAT_TOKENS]
    vocabulary = words_of(*words) + list(DIGITS) + words_of(*GLM_OCR_PROMPTS, kie_prompt())
    return build_word_level_tokenizer(
        text_config.vocab_size, placed, special, vocabulary, text_config.max_position_embeddings, **named
    )


def make_glm_ocr_mote_processor(config, tokenizer=None, words: tuple[str, ...] = ()) -> GlmOcrMoteProcessor:
    """
    The GLM-OCR-MoTE processor of `config`: GLM-OCR's image processing with the vision tower's patch, merge and
    temporal sizes, GLM-OCR's pixel limits measured in merged tokens (exactly its 12,544 and 9,633,792 pixels at 14-px
    patches); the routes of `text_config.mote_expert_names`. Without `tokenizer`, a tiny vocabulary gets one built
    offline and a real one GLM-OCR's.
    """
    if tokenizer is None:
        if config.text_config.vocab_size <= LARGEST_TINY_VOCABULARY:
            tokenizer = build_tiny_glm_ocr_tokenizer(config, words)
        else:
            tokenizer = _load_tokenizer(GLM_OCR_TOKENIZER_REPO)
    vision = config.vision_config
    pixels_per_merged_token = vision.temporal_patch_size * (vision.patch_size * vision.spatial_merge_size) ** 2
    image_processor = Glm46VImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        size={
            "shortest_edge": GLM_MIN_MERGED_TOKENS * pixels_per_merged_token,
            "longest_edge": GLM_MAX_MERGED_TOKENS * pixels_per_merged_token,
        },
    )
    return GlmOcrMoteProcessor(
        image_processor,
        tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None) or GLM_CHAT_TEMPLATE,
        expert_names=config.text_config.mote_expert_names,
    )
