"""Processor for MoEMB: queries and targets formatted for the Qwen3.5 backbone, each ending in the `<emb>` token.

An input to embed is a dict (or a plain string, meaning `{"text": ...}`):

    {"instruction": "Retrieve the caption of the image.", "text": "a dog", "images": [image], "video": frames}

every key optional, but at least one of `text`, `images` and `video` given. `images` is one image or a list (PIL
images, numpy arrays, torch tensors, or file paths); `video` is a list of frames (same kinds), a 4D array, or a
folder of frame images. Video files must be decoded into frames first: the processor needs no video decoder.

**Prompt** (spec moemb.md §6.2). With the default `"chat"` template an input becomes

    <|im_start|>user\n{instruction}\n{visual}{text}<|im_end|>\n<|im_start|>assistant\n<emb>

and with `"raw"` one `{instruction}\n{visual}{text}<emb>`; `{instruction}\n` is left out when there is no
instruction. `{visual}` holds one placeholder per image, then the video's. A text (or instruction) may place them
itself with `<|image_pad|>` and `<|video_pad|>` (or the wrapped `<|vision_start|><|image_pad|><|vision_end|>`):
then their count must match the images and video given. MMEB's `<|image_1|>` is converted by `from_mmeb_record`.

**Expansion** reproduces what the stock Qwen3.5 processor (`Qwen3VLProcessor`) and chat template produce, the
format the backbone was pretrained on:

- an image becomes `<|vision_start|>` + `<|image_pad|>` x (t*h*w / merge^2) + `<|vision_end|>`;
- a video becomes, for each temporal step, `<{seconds:.1f} seconds>` + `<|vision_start|>` + `<|video_pad|>` x
  (h*w / merge^2) + `<|vision_end|>`, with no outer start/end pair: transformers 5.x replaces only the bare
  `<|video_pad|>` and would leave the template's wrapper around the frames (spec A-34); qwen-vl-utils and the
  original Qwen3-VL processor replace the wrapped placeholder as a whole, as done here.

**Outputs** (`BatchFeature`): `input_ids`, `attention_mask`, `mm_token_type_ids` (0 text, 1 image, 2 video),
`pooled_index` (the position of `<emb>` in each row, whatever the padding side), and when present `pixel_values`
`(num_patches, 3 * temporal_patch * patch^2)` with `image_grid_thw`, and `pixel_values_videos` with
`video_grid_thw`. `processor(queries=..., targets=...)` returns `{"query": BatchFeature, "target": BatchFeature}`.

Images go through `MoEmbImageProcessor` (transformers' PIL-backend Qwen2-VL image processor with Qwen3.5's patch
16 and mean = std = 0.5). transformers' Qwen3-VL video processor needs torchvision, so `MoEmbVideoProcessor`
re-implements it on PIL and numpy: the same frame sampling, `smart_resize` and patch layout; frames are resized with
PIL's bicubic filter rather than torchvision's, which differs by a few intensity levels on resampled pixels.

This file is copied as is into exported Hub folders, where moezoo is not installed: besides the standard library,
numpy and transformers it imports only from `images.py` and `inputs.py`, which are copied beside it.
"""

import re
from pathlib import Path

import numpy as np
from transformers.image_processing_utils import BatchFeature
from transformers.image_transforms import resize
from transformers.image_utils import ChannelDimension, is_valid_image, load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize_video
from transformers.processing_utils import ProcessorMixin

from .images import open_image
from .inputs import check_image, describe

EMB_TOKEN = "<emb>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
# The image placeholder of MMEB / VLM2Vec records (Phi-3-V's image token).
MMEB_IMAGE_TOKEN = "<|image_1|>"

PROMPT_TEMPLATES = {
    "chat": IM_START + "user\n{content}" + IM_END + "\n" + IM_START + "assistant\n{pooling_token}",
    "raw": "{content}{pooling_token}",
}
INPUT_KEYS = ("instruction", "text", "images", "video")
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def add_emb_token(tokenizer, emb_token: str = EMB_TOKEN) -> int:
    """Add `emb_token` to `tokenizer` as a special token if it is missing; return its id.

    Qwen3.5's embedding matrix has more rows (248320) than its tokenizer has tokens, so the new id usually needs no
    resize: the conversion checks that it is below the model's vocabulary size.
    """
    if emb_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"extra_special_tokens": [emb_token]}, replace_extra_special_tokens=False)
    return tokenizer.convert_tokens_to_ids(emb_token)


class MoEmbImageProcessor(Qwen2VLImageProcessorPil):
    r"""
    Qwen3.5's image processor on transformers' PIL backend (no torchvision), with Qwen3.5's patching: 16 px patches,
    2 frames per temporal patch (a still image is duplicated), 2 x 2 patches merged into one LLM token, and
    mean = std = 0.5.

    Each image is resized with `smart_resize` to multiples of `patch_size * merge_size` pixels, between
    `size["shortest_edge"]` and `size["longest_edge"]` pixels in area. The defaults keep every image between 4 and
    1024 visual tokens (spec §6.2, A-7).
    """

    patch_size = 16
    temporal_patch_size = 2
    merge_size = 2
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    size = {"shortest_edge": 4 * 32 * 32, "longest_edge": 1024 * 32 * 32}


def sample_frame_indices(num_total_frames: int, num_frames: int) -> list[int]:
    """`num_frames` indices spread uniformly over a video, first and last included, rounded as Qwen3-VL's
    `sample_frames` does; shorter videos keep all their frames (none repeated)."""
    if num_total_frames <= num_frames:
        return list(range(num_total_frames))
    return np.linspace(0, num_total_frames - 1, num_frames).round().astype(int).tolist()


def temporal_step_seconds(frame_indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """The time of each temporal patch: the mean of its first and last frame times, the last patch completed by
    repeating the last frame (`Qwen3VLProcessor._calculate_timestamps`)."""
    indices = list(frame_indices)
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    times = [index / fps for index in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def patchify_frames(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int):
    """`(T, C, H, W)` frames -> `(t * h * w, C * temporal_patch_size * patch^2)` patches and the grid `(t, h, w)`.

    The layout is the one of Qwen3-VL's video processor (and of the image processor, whose still image is one
    temporal patch of two identical frames): temporal patches, then 2 x 2 merge groups row by row, then the patches
    of a group, each flattened as (channel, frame, row, column). A last incomplete temporal patch repeats the last
    frame.
    """
    if pad := -len(frames) % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    patches = frames.reshape(
        grid_t, temporal_patch_size, channels,
        grid_h // merge_size, merge_size, patch_size,
        grid_w // merge_size, merge_size, patch_size,
    )  # fmt: skip
    # -> (t, gh, gw, mh, mw, C, T, ph, pw)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = patches.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
    return patches, (grid_t, grid_h, grid_w)


def load_frames(video) -> list:
    """A video as a list of frames: a list or tuple of frames, a 4D array, or a folder of frame images (sorted)."""
    if isinstance(video, (str, Path)):
        folder = Path(video)
        if not folder.is_dir():
            raise ValueError(
                f"video {str(video)!r} is not a folder of frames: decode video files into frames first (a list of "
                f"images, a (frames, height, width, channels) array, or a folder of {'/'.join(FRAME_SUFFIXES)} files)"
            )
        frames = sorted(path for path in folder.iterdir() if path.suffix.lower() in FRAME_SUFFIXES)
        if not frames:
            raise ValueError(f"the video folder {folder} holds no frame images ({', '.join(FRAME_SUFFIXES)})")
        return [str(path) for path in frames]
    if (is_valid_image(video) and getattr(video, "ndim", 0) == 4) or isinstance(video, (list, tuple)):
        if len(video) > 0:
            return list(video)
    raise ValueError(
        f"a video must be a non-empty list of frames, a (frames, height, width, channels) array or a folder of frames, "
        f"got {describe(video)}" + (" (a still image goes in 'images')" if is_valid_image(video) else "")
    )


class MoEmbVideoProcessor:
    r"""
    Qwen3-VL's video preprocessing on PIL and numpy: `num_frames` frames sampled uniformly, all resized to one size
    chosen by Qwen3-VL's video `smart_resize` (multiples of `patch_size * merge_size`, total pixels over the frames
    between `size["shortest_edge"]` and `size["longest_edge"]`), rescaled and normalised like images, then patchified
    (see `patchify_frames`).

    Built on access by [`MoEmbProcessor`] from its image processor, so both share patch sizes, normalisation and
    resampling. Returns `pixel_values_videos`, `video_grid_thw` and `video_seconds`, the time of every temporal step
    (frame index / `fps`), which the prompt shows.
    """

    def __init__(self, image_processor: MoEmbImageProcessor, num_frames: int, size: dict, fps: float):
        self.image_processor = image_processor
        self.num_frames = num_frames
        self.size = size
        self.fps = fps

    def __call__(self, videos: list) -> BatchFeature:
        processor = self.image_processor
        factor = processor.patch_size * processor.merge_size
        pixel_values, grids, seconds = [], [], []
        for index, video in enumerate(videos):
            frames = load_frames(video)
            for number, frame in enumerate(frames):
                check_image(frame, f"video {index}, frame {number}", paths=True)
            indices = sample_frame_indices(len(frames), self.num_frames)
            frames = [processor.process_image(_open(frames[i]), do_convert_rgb=True) for i in indices]
            sizes = {frame.shape[-2:] for frame in frames}
            if len(sizes) > 1:
                raise ValueError(f"the frames of a video must share one size, got {sorted(sizes)}")
            # Qwen3-VL needs at least one full temporal patch to size a video.
            height, width = smart_resize_video(
                max(len(frames), processor.temporal_patch_size), *frames[0].shape[-2:],
                temporal_factor=processor.temporal_patch_size, factor=factor,
                min_pixels=self.size["shortest_edge"], max_pixels=self.size["longest_edge"],
            )  # fmt: skip
            frames = np.stack([self._frame(frame, height, width) for frame in frames])
            patches, grid = patchify_frames(
                frames, processor.patch_size, processor.merge_size, processor.temporal_patch_size
            )
            pixel_values.append(patches)
            grids.append(grid)
            seconds.append(temporal_step_seconds(indices, self.fps, processor.temporal_patch_size))
        return BatchFeature(
            {
                "pixel_values_videos": np.concatenate(pixel_values).astype(np.float32),
                "video_grid_thw": np.array(grids, dtype=np.int64),
                "video_seconds": seconds,
            }
        )

    def _frame(self, frame: np.ndarray, height: int, width: int) -> np.ndarray:
        processor = self.image_processor
        frame = resize(
            frame, (height, width), resample=processor.resample,
            data_format=ChannelDimension.FIRST, input_data_format=ChannelDimension.FIRST,
        )  # fmt: skip
        # The image processor's switches hold for frames too: with do_rescale=False, float frames in [0, 1] are used
        # as they are, as float images are, instead of being divided by 255 a second time.
        if processor.do_rescale:
            frame = processor.rescale(frame, processor.rescale_factor)
        if processor.do_normalize:
            frame = processor.normalize(frame, processor.image_mean, processor.image_std)
        return frame.astype(np.float32)


def _open(image):
    """A file path opened as it displays (`open_image`: EXIF orientation, transparency on white, 16-bit scaled, an
    unreadable file named) or a URL as transformers opens it; images and arrays as they are."""
    if not isinstance(image, (str, Path)):
        return image
    return load_image(image) if str(image).startswith(("http://", "https://")) else open_image(image)


class MoEmbProcessor(ProcessorMixin):
    r"""
    Formats instructions with queries or targets for MoEMB and batches text, image, video and mixed inputs in the
    Qwen3.5 format (see the module docstring).

    Args:
        image_processor ([`MoEmbImageProcessor`]):
            Images and, through [`MoEmbVideoProcessor`], video frames.
        tokenizer ([`PreTrainedTokenizerBase`]):
            Qwen3.5's tokenizer with `<emb>` added (`add_emb_token`); it must know the chat and vision tokens.
        emb_token (`str` or `None`, *optional*, defaults to `"<emb>"`):
            Appended to every input, the token whose last hidden state is the embedding. `None` appends nothing
            (last-token pooling of the template's last token, the ablation of Table 5).
        prompt_template (`str`, *optional*, defaults to `"chat"`):
            `"chat"` (a user turn, `<emb>` as the assistant's first token) or `"raw"` (spec A-6).
        num_frames (`int`, *optional*, defaults to 8):
            Frames sampled per video (spec A-7).
        video_size (`dict`, *optional*):
            `{"shortest_edge", "longest_edge"}` bounds on the total pixels of a video's sampled frames; defaults to
            at most 256 tokens per temporal step of `num_frames` frames.
        video_fps (`float`, *optional*, defaults to 2.0):
            The frame rate of the frames given, for the timestamps of the prompt (Qwen3-VL samples 2 frames per
            second from video files).
        max_length (`int`, *optional*, defaults to 8192):
            Longest input in tokens. Longer inputs lose the end of their text (never the instruction, the visual
            tokens or `<emb>`); inputs whose visual tokens alone are too long raise an error.
    """

    def __init__(
        self,
        image_processor,
        tokenizer,
        emb_token: str | None = EMB_TOKEN,
        prompt_template: str = "chat",
        num_frames: int = 8,
        video_size: dict | None = None,
        video_fps: float = 2.0,
        max_length: int = 8192,
        chat_template=None,
    ):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        if prompt_template not in PROMPT_TEMPLATES:
            raise ValueError(f"prompt_template must be one of {', '.join(PROMPT_TEMPLATES)}, got {prompt_template!r}")
        if num_frames < 1:
            raise ValueError(f"num_frames must be at least 1, got {num_frames}")
        self.emb_token = emb_token
        self.prompt_template = prompt_template
        self.num_frames = num_frames
        token_area = (image_processor.patch_size * image_processor.merge_size) ** 2  # pixels per visual token
        # Qwen3-VL's lower bound; at most 256 tokens per frame (spec A-7).
        self.video_size = video_size or {
            "shortest_edge": 128 * token_area, "longest_edge": num_frames * 256 * token_area
        }
        self.video_fps = video_fps
        self.max_length = max_length

        self.image_token, self.video_token = IMAGE_TOKEN, VIDEO_TOKEN
        required = [IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END]
        required += [IM_START, IM_END] if prompt_template == "chat" else []
        required += [emb_token] if emb_token else []
        vocab = tokenizer.get_vocab()
        missing = [token for token in required if token not in vocab]
        if missing:
            raise ValueError(
                f"the tokenizer lacks {', '.join(missing)}: MoEMB needs Qwen3.5's tokenizer with {EMB_TOKEN} added "
                "(add_emb_token(tokenizer))"
            )
        self.image_token_id, self.video_token_id = vocab[IMAGE_TOKEN], vocab[VIDEO_TOKEN]
        self.emb_token_id = vocab[emb_token] if emb_token else None
        # The wrapped form first, so that a template's <|vision_start|><|image_pad|><|vision_end|> is replaced whole.
        self._image_placeholder, self._video_placeholder = (
            re.compile(f"{re.escape(VISION_START + token + VISION_END)}|{re.escape(token)}")
            for token in (IMAGE_TOKEN, VIDEO_TOKEN)
        )
        self._any_placeholder = re.compile(f"({self._image_placeholder.pattern}|{self._video_placeholder.pattern})")

    @property
    def video_processor(self) -> MoEmbVideoProcessor:
        # Built on access, not stored: ProcessorMixin would save and load a stored one with AutoVideoProcessor,
        # whose Qwen3-VL class needs torchvision.
        return MoEmbVideoProcessor(self.image_processor, self.num_frames, self.video_size, self.video_fps)

    @property
    def model_input_names(self) -> list[str]:
        return [
            "input_ids", "attention_mask", "mm_token_type_ids", "pooled_index", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw",
        ]  # fmt: skip

    def __call__(
        self,
        inputs=None,
        *,
        queries=None,
        targets=None,
        padding_side: str = "right",
        max_length: int | None = None,
        return_tensors: str | None = "pt",
        **unknown,
    ):
        """
        Process a list of inputs (dicts or strings, see the module docstring) into one batch, or `queries` and
        `targets` into `{"query": batch, "target": batch}`.
        """
        if unknown:
            # Users of transformers' processors write text=..., images=...: say how this one takes them.
            raise ValueError(
                f"MoEmbProcessor has no option {', '.join(sorted(unknown))}: pass a list of inputs, each a text or a "
                f"dict with keys among {', '.join(INPUT_KEYS)} (processor(['a cat', {{'images': [image]}}])), or "
                "queries= and targets=; its options are padding_side, max_length and return_tensors"
            )
        if (inputs is None) == (queries is None and targets is None):
            raise ValueError("pass either a list of inputs, or queries= and/or targets=")
        options = {"padding_side": padding_side, "max_length": max_length, "return_tensors": return_tensors}
        if inputs is not None:
            return self._batch(inputs, **options)
        sides = {"query": queries, "target": targets}
        return {side: self._batch(items, **options) for side, items in sides.items() if items is not None}

    # --- prompts --------------------------------------------------------------------------------------------------

    def format_prompt(self, item) -> str:
        """The prompt of one input before its placeholders are expanded: the template filled with the instruction,
        one bare placeholder per image and video the text does not place itself, and the text."""
        return self._prompt(normalize_input(item), text=None, index=0)

    def _prompt(self, item: dict, text: str | None, index: int) -> str:
        """`format_prompt` of normalised input `index`, with `text` in place of its own when given (truncation)."""
        instruction = item["instruction"] or ""
        text = (item["text"] or "") if text is None else text
        written = f"{instruction}\n{text}"
        num_images = len(self._image_placeholder.findall(written))
        num_videos = len(self._video_placeholder.findall(written))
        if num_images not in (0, len(item["images"])):
            raise ValueError(
                f"input {index}: the text has {num_images} image placeholder(s) {IMAGE_TOKEN} but "
                f"{len(item['images'])} image(s) are given: write one placeholder per image, or none to put the images "
                "before the text"
            )
        has_video = item["video"] is not None
        if num_videos not in (0, int(has_video)):
            raise ValueError(
                f"input {index}: the text has {num_videos} video placeholder(s) {VIDEO_TOKEN} but {int(has_video)} "
                "video is given: an input holds at most one video; write one placeholder, or none to put the video "
                "before the text"
            )
        content = f"{instruction}\n" if instruction else ""
        content += IMAGE_TOKEN * len(item["images"]) if num_images == 0 else ""
        content += VIDEO_TOKEN if num_videos == 0 and has_video else ""
        return PROMPT_TEMPLATES[self.prompt_template].format(
            content=content + text, pooling_token=self.emb_token or ""
        )

    def expand_placeholders(self, prompt: str, image_tokens: list[int], video_blocks: list[str]) -> str:
        """Replace the image placeholders by `<|vision_start|>`, as many `<|image_pad|>` as each image has tokens
        and `<|vision_end|>`, and the video placeholder by its block (see `video_block`)."""
        images, videos = iter(image_tokens), iter(video_blocks)
        prompt = self._image_placeholder.sub(lambda _: VISION_START + IMAGE_TOKEN * next(images) + VISION_END, prompt)
        return self._video_placeholder.sub(lambda _: next(videos), prompt)

    def video_block(self, grid: tuple[int, int, int], seconds: list[float]) -> str:
        """A video's tokens: per temporal step, its time and its frame tokens between vision start and end."""
        tokens_per_step = grid[1] * grid[2] // self.image_processor.merge_size**2
        return "".join(
            f"<{time:.1f} seconds>" + VISION_START + VIDEO_TOKEN * tokens_per_step + VISION_END for time in seconds
        )

    # --- batches --------------------------------------------------------------------------------------------------

    def _batch(self, items, padding_side: str, max_length: int | None, return_tensors: str | None) -> BatchFeature:
        if isinstance(items, (str, dict)):
            raise ValueError("pass a list of inputs, even for a single one: [input]")
        if not isinstance(items, (list, tuple)):
            raise ValueError(
                f"the inputs are {describe(items)}; pass a list of inputs, each a text or a dict with keys among "
                f"{', '.join(INPUT_KEYS)}"
            )
        items = [normalize_input(item, index) for index, item in enumerate(items)]
        if not items:
            raise ValueError("no inputs to process: pass at least one")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")

        # Images and videos of the whole batch are processed at once, in input order; each input then takes its own.
        data = {}
        image_tokens, video_blocks = iter(()), iter(())
        images = [image for item in items for image in item["images"]]
        if images:
            pixels = self.image_processor([_open(image) for image in images], return_tensors=None)
            data |= {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
            image_tokens = iter((pixels["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
        videos = [item["video"] for item in items if item["video"] is not None]
        if videos:
            frames = self.video_processor(videos)
            data |= {"pixel_values_videos": frames["pixel_values_videos"], "video_grid_thw": frames["video_grid_thw"]}
            grids = frames["video_grid_thw"].tolist()
            video_blocks = iter(
                self.video_block(grid, seconds) for grid, seconds in zip(grids, frames["video_seconds"])
            )

        input_ids = []
        for index, item in enumerate(items):
            item_image_tokens = [next(image_tokens) for _ in item["images"]]
            item_video_blocks = [next(video_blocks)] if item["video"] is not None else []
            input_ids.append(
                self._tokenize(item, item_image_tokens, item_video_blocks, max_length or self.max_length, index)
            )

        text = self.tokenizer.pad(
            {"input_ids": input_ids}, padding=True, padding_side=padding_side, return_tensors="np"
        )
        data["input_ids"], data["attention_mask"] = text["input_ids"], text["attention_mask"]
        data["mm_token_type_ids"] = np.array(self.create_mm_token_type_ids(text["input_ids"]))
        # The pooled token is the last real token of each row.
        lengths = text["attention_mask"].sum(-1)
        last = text["input_ids"].shape[1] - 1
        data["pooled_index"] = lengths - 1 if padding_side == "right" else np.full_like(lengths, last)
        return BatchFeature(data, tensor_type=return_tensors)

    def _tokenize(self, item: dict, image_tokens: list[int], video_blocks: list[str], max_length: int, index: int):
        """Token ids of one input, its text shortened from the end until the input fits in `max_length`."""
        text = item["text"] or ""
        while True:
            prompt = self.expand_placeholders(self._prompt(item, text, index), image_tokens, video_blocks)
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            excess = len(ids) - max_length
            if excess <= 0:
                return ids
            shorter = self._shorten_text(text, excess)
            if shorter == text:
                raise ValueError(
                    f"input {index} needs {len(ids)} tokens, more than max_length={max_length}, without any text left "
                    "to cut: its images, video, instruction and prompt take that much. Raise max_length, or lower the "
                    "image or video resolution (image_processor.size, video_size) or num_frames"
                )
            text = shorter

    def _shorten_text(self, text: str, excess: int) -> str:
        """`text` with about `excess` tokens removed from its end, skipping over the visual placeholders it places
        itself. Tokens merge across the cut, so the caller checks the length again."""
        parts = self._any_placeholder.split(text)  # plain text at even indices, placeholders at odd ones
        for position in reversed(range(0, len(parts), 2)):
            ids = self.tokenizer(parts[position], add_special_tokens=False)["input_ids"]
            cut = min(excess, len(ids))
            parts[position] = self.tokenizer.decode(ids[: len(ids) - cut])
            excess -= cut
            if excess == 0:
                break
        return "".join(parts)

    # --- MMEB records ---------------------------------------------------------------------------------------------

    @staticmethod
    def from_mmeb_record(record: dict, side: str = "query", image_root: str | Path | None = None) -> dict:
        """An input from a record of MMEB's training format (VLM2Vec: `qry`, `qry_image_path`, `pos_text`,
        `pos_image_path`, `neg_text`, `neg_image_path`): `side` is "query", "target" (the positive) or "negative".
        The instruction is inline in MMEB's texts; its image token `<|image_1|>` becomes Qwen's placeholder."""
        fields = {"query": ("qry", "qry_image_path"), "target": ("pos_text", "pos_image_path"),
                  "negative": ("neg_text", "neg_image_path")}  # fmt: skip
        if side not in fields:
            raise ValueError(f"side must be one of {', '.join(fields)}, got {side!r}")
        text_field, image_field = fields[side]
        return mmeb_input(record.get(text_field), record.get(image_field), image_root)


def mmeb_input(text: str | None, image=None, image_root: str | Path | None = None, video=None) -> dict:
    """An input from an MMEB text (its `<|image_1|>` made Qwen's image placeholder), an image and a video (MMEB-V2's
    video tasks; a folder of frames): paths relative to `image_root`, opened media, or empty for none."""
    item = {"text": (text or "").replace(MMEB_IMAGE_TOKEN, IMAGE_TOKEN) or None}
    for key, media in (("images", image), ("video", video)):
        if media is None or (isinstance(media, str) and media == ""):
            continue
        if isinstance(media, str) and image_root is not None:
            media = str(Path(image_root) / media)
        item[key] = [media] if key == "images" else media
    return item


def normalize_input(item, index: int = 0) -> dict:
    """An input as a dict with all of `INPUT_KEYS` (`images` a list), checked; strings are texts."""
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise ValueError(
            f"input {index} is a {type(item).__name__}; give a text or a dict with keys among {', '.join(INPUT_KEYS)}"
        )
    unknown = sorted(set(item) - set(INPUT_KEYS))
    if unknown:
        raise ValueError(f"input {index} has unknown key(s) {', '.join(unknown)}; the keys are {', '.join(INPUT_KEYS)}")
    images = item.get("images")
    if images is None:
        images = []
    elif not isinstance(images, (list, tuple)):
        images = [images]
    for number, image in enumerate(images):
        # The image processor would take a 4D array or a nested list for several images, while the prompt gets one
        # placeholder per entry: the visual tokens would no longer match the pixels.
        check_image(image, f"input {index}: image {number}", paths=True)
    for key in ("instruction", "text"):
        if item.get(key) is not None and not isinstance(item[key], str):
            raise ValueError(f"input {index}: {key!r} must be a string, got {type(item[key]).__name__}")
    if not (item.get("text") or images or item.get("video") is not None):
        raise ValueError(
            f"input {index} has nothing to embed: give it a 'text', 'images' or a 'video' (an instruction alone "
            "only says what to do with them)"
        )
    return {"instruction": item.get("instruction"), "text": item.get("text"), "images": list(images),
            "video": item.get("video")}  # fmt: skip


__all__ = ["MoEmbImageProcessor", "MoEmbProcessor", "MoEmbVideoProcessor", "add_emb_token", "mmeb_input"]
