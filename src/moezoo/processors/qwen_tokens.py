"""The special tokens of Qwen's vocabularies that the zoo's Qwen-based processors write (Qwen3-VL, Qwen3.5 and Qwen3
chat templates name them alike), and where Qwen3.5's own tokenizer lives."""

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
END_OF_TEXT = "<|endoftext|>"  # Qwen's pad token

QWEN3_5_TOKENIZER_REPO = "Qwen/Qwen3.5-35B-A3B"
