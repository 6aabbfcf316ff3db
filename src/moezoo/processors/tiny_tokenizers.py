"""Tiny CLIP-format BPE tokenizers, built offline for tests and examples.

Real MoE-ViE checkpoints use OpenAI's CLIP BPE vocabulary (49,408 tokens), which comes from the Hub. Tests cannot
download it, so `build_tiny_clip_tokenizer` builds a `CLIPTokenizer` in the same format from a short word list:
byte-level symbols with the `</w>` end-of-word suffix, CLIP's lower-casing normaliser and pre-tokenizer, and the
start/end-of-text tokens as the last two ids. With the defaults it matches the tiny MoE-ViE test config: 99 tokens,
pad 0, `<|startoftext|>` 97, `<|endoftext|>` 98, context length 16.
"""

from string import ascii_lowercase

from tokenizers.models import BPE
from transformers import CLIPTokenizer

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
