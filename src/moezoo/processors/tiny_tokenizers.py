"""Tiny BPE tokenizers in the formats of CLIP and Qwen, built offline for tests, examples and tiny presets.

Real MoE-ViE checkpoints use OpenAI's CLIP BPE vocabulary (49,408 tokens), which comes from the Hub. Tests cannot
download it, so `build_tiny_clip_tokenizer` builds a `CLIPTokenizer` in the same format from a short word list:
byte-level symbols with the `</w>` end-of-word suffix, CLIP's lower-casing normaliser and pre-tokenizer, and the
start/end-of-text tokens as the last two ids. With the defaults it matches the tiny MoE-ViE test config: 99 tokens,
pad 0, `<|startoftext|>` 97, `<|endoftext|>` 98, context length 16.

Qwen-based architectures (MoEMB, OmniMoE-VL, SMoES) with a tiny text vocabulary get `build_tiny_qwen_tokenizer`: a
`Qwen3_5Tokenizer` in Qwen's byte-level format whose special tokens sit at the ids their config names.
"""

from string import ascii_lowercase

from tokenizers.models import BPE
from transformers import CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from .qwen_tokens import END_OF_TEXT

# Qwen-format vocabularies up to this size get a tiny tokenizer built offline; larger ones are real Qwen vocabularies.
LARGEST_TINY_QWEN_VOCABULARY = 4096

PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
END_OF_WORD_SUFFIX = "</w>"

DEFAULT_ALPHABET = ascii_lowercase + ".,"
# Words of the default prompts ("a photo of a cat.") first, so that they are whole tokens.
DEFAULT_WORDS = (
    "a", "photo", "of", "the", "cat", "dog", "this", "is", "an", "image",
    "bird", "car", "red", "blue", "green", "tree", "house", "sky",
)  # fmt: skip


def build_tiny_clip_tokenizer(
    words: tuple[str, ...] | list[str] = DEFAULT_WORDS,
    vocab_size: int = 99,
    model_max_length: int = 16,
    alphabet: str = DEFAULT_ALPHABET,
) -> CLIPTokenizer:
    """
    Build a `CLIPTokenizer` with a `vocab_size`-token BPE vocabulary, deterministically and without downloads.

    Vocabulary layout, like CLIP's (bytes, bytes + `</w>`, merges, then start/end of text):

    - 0 `<|pad|>`, the tiny config's pad id (the official tokenizer pads with 0 too);
    - 1 `<|unk|>`, for characters outside `alphabet`. CLIP maps unknown pieces to `<|endoftext|>`, harmless for its
      complete byte alphabet but wrong here: the text tower pools at the first end-of-text token;
    - every character of `alphabet`, then every character + `</w>`;
    - the tokens made by the merges;
    - `vocab_size - 2` `<|startoftext|>` and `vocab_size - 1` `<|endoftext|>`.

    The merges make each word of `words`, in order, a single token, until the vocabulary is full: a word is split by
    the merges so far (with the `tokenizers` BPE model) and its pieces are then merged left to right. The `tokenizers`
    BPE trainer is not used because it breaks ties between equally frequent pairs in hash-map order, which changes
    from one process to the next.

    Args:
        words: Words to learn, made of letters of `alphabet`; lower-case, as the tokenizer lower-cases its input.
        vocab_size: Size of the vocabulary, special tokens included; `words` must be long enough to fill it.
        model_max_length: Context length; longer texts are truncated to it (end-of-text kept last) when asked.
        alphabet: Printable ASCII characters the tokenizer knows; anything else becomes `<|unk|>`.
    """
    for word in words:
        if not (word.isalpha() and word.islower() and set(word) <= set(alphabet)):
            raise ValueError(f"Word {word!r} must be made of lower-case letters from the alphabet {alphabet!r}.")
    vocab = {PAD_TOKEN: 0, UNK_TOKEN: 1}
    for symbol in [*alphabet, *(character + END_OF_WORD_SUFFIX for character in alphabet)]:
        vocab[symbol] = len(vocab)
    num_regular_tokens = vocab_size - 2  # room left for the start and end of text tokens
    if len(vocab) > num_regular_tokens:
        raise ValueError(f"vocab_size={vocab_size} is too small for the {len(alphabet)}-character alphabet.")

    merges = []
    for word in words:
        model = BPE(vocab=vocab, merges=merges, unk_token=UNK_TOKEN, end_of_word_suffix=END_OF_WORD_SUFFIX)
        pieces = [token.value for token in model.tokenize(word)]
        while len(pieces) > 1 and len(vocab) < num_regular_tokens:
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
            vocab.setdefault(pieces[0], len(vocab))
    if len(vocab) < num_regular_tokens:
        raise ValueError(
            f"The {len(words)} words give only {len(vocab) + 2} tokens; add words to reach vocab_size={vocab_size}."
        )
    vocab[BOS_TOKEN] = len(vocab)
    vocab[EOS_TOKEN] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )


# Printable ASCII that tiny tokenizers spell out; other characters are dropped (byte-level BPE without fallback).
TINY_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,:;?!'\"-()<>/"
)
# Whole tokens first for the words of the prompt template, the instructions and moezoo's synthetic data sets.
TINY_WORDS = (
    "user", "assistant", " a", " the", " of", " red", " green", " blue", " yellow", " circle", " square", " triangle",
    " cross", " moving", " left", " right", " up", " down", " photo", " image", " caption", " seconds", " Find",
    " Represent", " given", " with", " and", " text", " video", " query",
)  # fmt: skip


def build_tiny_qwen_tokenizer(
    vocab_size: int, special_tokens: dict[str, int | None], words=TINY_WORDS, alphabet: str = TINY_ALPHABET
) -> Qwen3_5Tokenizer:
    """
    A `Qwen3_5Tokenizer` (byte-level BPE, Qwen's pre-tokenizer) of at most `vocab_size` tokens, built without
    downloads, with each special token of `special_tokens` at its given id, or at the highest free ids for those
    given `None`.

    The other ids, from 0 up, hold the byte-level symbols of `alphabet`, then the tokens made by merging each word of
    `words` left to right (a leading space is part of a word, as Qwen's pre-tokenizer keeps it), until the ids run
    out. `<|endoftext|>`, Qwen's pad token, must be among the special tokens.
    """
    if END_OF_TEXT not in special_tokens:
        raise ValueError(f"special_tokens must include {END_OF_TEXT}, the pad token")
    given = [i for i in special_tokens.values() if i is not None]
    if len(set(given)) != len(given) or not all(0 <= i < vocab_size for i in given):
        raise ValueError(f"special token ids must be distinct and below vocab_size={vocab_size}: {special_tokens}")
    free = [i for i in range(vocab_size) if i not in given]
    special_tokens = {token: free.pop() if i is None else i for token, i in special_tokens.items()}

    byte_symbol = bytes_to_unicode()
    symbols = list(dict.fromkeys(byte_symbol[byte] for character in alphabet for byte in character.encode()))
    if len(symbols) > len(free):
        raise ValueError(f"vocab_size={vocab_size} leaves {len(free)} ids, fewer than the {len(symbols)} characters")
    vocab = dict(zip(symbols, free))
    free = free[len(symbols) :]
    merges = []
    for word in words:
        pieces = [byte_symbol[byte] for byte in word.encode()]
        while len(pieces) > 1 and free:
            merged = pieces[0] + pieces[1]
            if merged not in vocab:
                merges.append((pieces[0], pieces[1]))
                vocab[merged] = free.pop(0)
            pieces = [merged, *pieces[2:]]
    vocab |= special_tokens
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [token for token in special_tokens if token != END_OF_TEXT]},
        replace_extra_special_tokens=False,
    )
    return tokenizer
