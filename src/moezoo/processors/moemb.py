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

**As a transformers processor**, `processor(text=..., images=..., videos=...)` takes prompts written beforehand, e.g.
by `apply_chat_template` (whose default template writes the chat prompt above), with the options of transformers'
processors (`ProcessorMixin._merge_kwargs`: `padding`, `max_length`, `num_frames`, ...), and gives the same outputs.

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
from transformers.image_utils import ChannelDimension, ImageInput, is_valid_image, load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize_video
from transformers.processing_utils import MultiModalData, ProcessingKwargs, Unpack, VideosKwargs
from transformers.tokenization_utils_base import TextInput
from transformers.utils import logging
from transformers.video_utils import VideoInput

from .images import open_image
from .inputs import ChecksInputs, check_image, describe, make_list_of_videos
from .qwen_tokens import IM_END, IM_START, IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START


logger = logging.get_logger(__name__)

EMB_TOKEN = "<emb>"
# The image placeholder of MMEB / VLM2Vec records (Phi-3-V's image token).
MMEB_IMAGE_TOKEN = "<|image_1|>"

PROMPT_TEMPLATES = {
    "chat": IM_START + "user\n{content}" + IM_END + "\n" + IM_START + "assistant\n{pooling_token}",
    "raw": "{content}{pooling_token}",
}
INPUT_KEYS = ("instruction", "text", "images", "video")
# MoEMB's "chat" prompt for `apply_chat_template`: ChatML without Qwen3.5's thinking blocks, each message's items in
# order (an image or a video as the chat template's wrapped placeholder), and as generation prompt the assistant turn
# that holds the pooling token, appended by `chat_template_for`. Newlines are Jinja expressions: the tags'
# whitespace control (`{%-`) would strip literal ones.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}"
)
# The options of MoEMB's own inputs (see `MoEmbProcessor`), with their defaults.
DEFAULT_MAX_LENGTH = 8192
EMBEDDING_OPTIONS = {"padding_side": "right", "max_length": DEFAULT_MAX_LENGTH, "return_tensors": "pt"}
# What the image processor holds for videos, which processors saved before it did held themselves.
FRAME_SETTINGS = ("num_frames", "video_size", "video_fps")
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def add_emb_token(tokenizer, emb_token: str = EMB_TOKEN) -> int:
    """Add `emb_token` to `tokenizer` as a special token if it is missing; return its id.

    Qwen3.5's embedding matrix has more rows (248320) than its tokenizer has tokens, so the new id usually needs no
    resize: the conversion checks that it is below the model's vocabulary size.
    """
    if emb_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"extra_special_tokens": [emb_token]}, replace_extra_special_tokens=False)
    return tokenizer.convert_tokens_to_ids(emb_token)


def chat_template_for(emb_token: str | None) -> str:
    """`CHAT_TEMPLATE` whose generation prompt ends with `emb_token` (none for last-token pooling), so that
    `apply_chat_template(messages, add_generation_prompt=True)` writes the prompt MoEMB embeds."""
    return CHAT_TEMPLATE + (emb_token or "") + "{%- endif -%}"


class MoEmbImageProcessor(Qwen2VLImageProcessorPil):
    r"""
    Qwen3.5's image processor on transformers' PIL backend (no torchvision), with Qwen3.5's patching: 16 px patches,
    2 frames per temporal patch (a still image is duplicated), 2 x 2 patches merged into one LLM token, and
    mean = std = 0.5.

    Each image is resized with `smart_resize` to multiples of `patch_size * merge_size` pixels, between
    `size["shortest_edge"]` and `size["longest_edge"]` pixels in area. The defaults keep every image between 4 and
    1024 visual tokens (spec §6.2, A-7).

    It is also the frame processor of [`MoEmbVideoProcessor`] (transformers' video processors need torchvision), so
    it saves the frame settings with its own; the processor's `num_frames`, `do_sample_frames` and `size` call
    options override them:

    - `num_frames` (8): frames sampled uniformly from each video (spec A-7);
    - `video_size` (`None`): `{"shortest_edge", "longest_edge"}` bounds on the total pixels of a video's sampled
      frames; `None` is Qwen3-VL's lower bound and at most 256 tokens per temporal step of `num_frames` frames;
    - `video_fps` (2.0): the frame rate of the frames given, for the timestamps of the prompt (Qwen3-VL samples 2
      frames per second from video files).
    """

    patch_size = 16
    temporal_patch_size = 2
    merge_size = 2
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    size = {"shortest_edge": 4 * 32 * 32, "longest_edge": 1024 * 32 * 32}
    num_frames = 8
    video_size = None
    video_fps = 2.0


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
    Qwen3-VL's video preprocessing on PIL and numpy: `num_frames` frames sampled uniformly (or, with
    `do_sample_frames=False`, every frame), all resized to one size chosen by Qwen3-VL's video `smart_resize`
    (multiples of `patch_size * merge_size`, total pixels over the frames between `size["shortest_edge"]` and
    `size["longest_edge"]`), rescaled and normalised like images, then patchified (see `patchify_frames`).

    Built on access by [`MoEmbProcessor`] from its image processor, which holds the frame settings (see
    [`MoEmbImageProcessor`]), so that both share patch sizes, normalisation and resampling. Returns
    `pixel_values_videos`, `video_grid_thw` and `video_seconds`, the time of every temporal step (frame index /
    `video_fps`), which the prompt shows.
    """

    valid_kwargs = VideosKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, image_processor: MoEmbImageProcessor):
        self.image_processor = image_processor

    def __call__(
        self,
        videos: list,
        num_frames: int | None = None,
        do_sample_frames: bool | None = None,
        size: dict | None = None,
        return_tensors: str | None = None,
        **unknown,
    ) -> BatchFeature:
        """Process a list of videos, each a list of frames (images or paths), a 4D array or a folder of frames."""
        # Options left at None ask for nothing (`fps=None`: no sampling by frame rate, which needs video metadata).
        unknown = [name for name, value in unknown.items() if value is not None]
        if unknown:
            raise ValueError(
                f"MoEMB's video processor has no option {', '.join(sorted(unknown))}; it takes num_frames, "
                "do_sample_frames and size (the image options of the image processor apply to frames too)"
            )
        processor = self.image_processor
        num_frames = processor.num_frames if num_frames is None else num_frames
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
        do_sample_frames = True if do_sample_frames is None else do_sample_frames  # sampling is the default
        pixel_values, grids, seconds = [], [], []
        for index, video in enumerate(videos):
            frames = load_frames(video)
            for number, frame in enumerate(frames):
                check_image(frame, f"video {index}, frame {number}", paths=True)
            indices = sample_frame_indices(len(frames), num_frames) if do_sample_frames else range(len(frames))
            frames = [processor.process_image(_open(frames[i]), do_convert_rgb=True) for i in indices]
            sizes = {frame.shape[-2:] for frame in frames}
            if len(sizes) > 1:
                raise ValueError(f"the frames of a video must share one size, got {sorted(sizes)}")
            height, width = self._resized_size(len(frames), *frames[0].shape[-2:], size or self._size(num_frames))
            frames = np.stack([self._frame(frame, height, width) for frame in frames])
            patches, grid = patchify_frames(
                frames, processor.patch_size, processor.merge_size, processor.temporal_patch_size
            )
            pixel_values.append(patches)
            grids.append(grid)
            seconds.append(temporal_step_seconds(list(indices), processor.video_fps, processor.temporal_patch_size))
        data = {
            "pixel_values_videos": np.concatenate(pixel_values).astype(np.float32),
            "video_grid_thw": np.array(grids, dtype=np.int64),
            "video_seconds": seconds,
        }
        return BatchFeature(data, tensor_type=return_tensors, skip_tensor_conversion=["video_seconds"])

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs: dict | None = None):
        """The number of patches of a video of `num_frames` frames (those it has once sampled) of `height` x `width`
        pixels, processed with `videos_kwargs` (the call options), as Qwen3-VL's video processor counts them."""
        videos_kwargs = videos_kwargs or {}
        processor = self.image_processor
        size = videos_kwargs.get("size") or self._size(videos_kwargs.get("num_frames") or processor.num_frames)
        height, width = self._resized_size(num_frames, height, width, size)
        grid_t = -(-num_frames // processor.temporal_patch_size)
        return grid_t * (height // processor.patch_size) * (width // processor.patch_size)

    def _size(self, num_frames: int) -> dict:
        """The image processor's `video_size`, or by default Qwen3-VL's lower bound and at most 256 tokens per
        temporal step of `num_frames` frames (spec A-7)."""
        processor = self.image_processor
        if processor.video_size is not None:
            return processor.video_size
        token_area = (processor.patch_size * processor.merge_size) ** 2  # pixels per visual token
        return {"shortest_edge": 128 * token_area, "longest_edge": num_frames * 256 * token_area}

    def _resized_size(self, num_frames: int, height: int, width: int, size: dict) -> tuple[int, int]:
        processor = self.image_processor
        # Qwen3-VL needs at least one full temporal patch to size a video.
        return smart_resize_video(
            max(num_frames, processor.temporal_patch_size), height, width,
            temporal_factor=processor.temporal_patch_size, factor=processor.patch_size * processor.merge_size,
            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
        )  # fmt: skip

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


def is_image_input(images) -> bool:
    """Whether `images` holds images as transformers' processors take them (an image, or a list, or a list of lists
    per text, of images) rather than MoEMB's own inputs (texts and dicts)."""
    if isinstance(images, (list, tuple)):
        return len(images) > 0 and all(
            is_image_input(entry) or (isinstance(entry, (list, tuple)) and not entry) for entry in images
        )
    return is_valid_image(images)


def last_real_token(attention_mask_row) -> int:
    """The position of the last real token of a row (where MoEMB's prompts hold `<emb>`), whichever side it is
    padded on."""
    return int(np.flatnonzero(np.asarray(attention_mask_row))[-1])


class MoEmbProcessor(ChecksInputs):
    r"""
    Formats instructions with queries or targets for MoEMB and batches text, image, video and mixed inputs in the
    Qwen3.5 format (see the module docstring).

    It takes inputs two ways:

    - MoEMB's own: `processor(inputs)`, a list of inputs (texts, or dicts with keys among `instruction`, `text`,
      `images` and `video`), or `processor(queries=..., targets=...)`, with the options `padding_side` ("right"),
      `max_length` (8192: longer inputs lose the end of their text, never the instruction, the visual tokens or
      `<emb>`) and `return_tensors` ("pt"). The prompt template and `<emb>` are added here.
    - transformers': `processor(text=..., images=..., videos=...)` on prompts written beforehand, each image and video
      placed by one `<|image_pad|>` or `<|video_pad|>` (the chat template's wrapped placeholders too), exactly as
      Qwen3.5's stock processor (`Qwen3VLProcessor`) expands them; options are routed to the tokenizer, the image
      processor and the video processor through `ProcessorMixin._merge_kwargs`, and `return_tensors` defaults to
      `None`, as Qwen3-VL's.

    Both return `input_ids`, `attention_mask`, `mm_token_type_ids`, `pooled_index` (the last real token of each row,
    `<emb>` in MoEMB's prompts) and the visual inputs of the module docstring. A list of strings given alone is a list
    of texts to embed: image paths go in `images=` beside `text=`, or in the inputs' `images`.

    Args:
        image_processor ([`MoEmbImageProcessor`]):
            Images and, through [`MoEmbVideoProcessor`], video frames; it holds the frame settings.
        tokenizer ([`PreTrainedTokenizerBase`]):
            Qwen3.5's tokenizer with `<emb>` added (`add_emb_token`); it must know the chat and vision tokens.
        emb_token (`str` or `None`, *optional*, defaults to `"<emb>"`):
            Appended to every input, the token whose last hidden state is the embedding. `None` appends nothing
            (last-token pooling of the template's last token, the ablation of Table 5).
        prompt_template (`str`, *optional*, defaults to `"chat"`):
            `"chat"` (a user turn, `<emb>` as the assistant's first token) or `"raw"` (spec A-6).
        chat_template (`str`, *optional*):
            The Jinja template of `apply_chat_template`; defaults to MoEMB's chat prompt (`chat_template_for`):
            ChatML, each message's images, videos and texts in order, and with `add_generation_prompt=True` the
            assistant turn with `emb_token`, what MoEMB embeds.
    """

    # As Qwen3-VL's processor: every call returns the token types, which MoEMB's modality routes read.
    return_mm_token_type_ids = True

    def __init__(
        self,
        image_processor,
        tokenizer,
        emb_token: str | None = EMB_TOKEN,
        prompt_template: str = "chat",
        chat_template=None,
    ):
        super().__init__(image_processor, tokenizer, chat_template=chat_template or chat_template_for(emb_token))
        if prompt_template not in PROMPT_TEMPLATES:
            raise ValueError(f"prompt_template must be one of {', '.join(PROMPT_TEMPLATES)}, got {prompt_template!r}")
        self.emb_token = emb_token
        self.prompt_template = prompt_template

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

    @classmethod
    def from_args_and_dict(cls, args, processor_dict: dict, **kwargs):
        # Folders saved before the frame settings moved to the image processor hold them in the processor's own
        # config: they go to the image processor, which owns them now. `max_length` became a call option.
        image_processor = args[cls.get_attributes().index("image_processor")]
        for key in FRAME_SETTINGS:
            if key in processor_dict:
                setattr(image_processor, key, processor_dict.pop(key))
        if processor_dict.pop("max_length", DEFAULT_MAX_LENGTH) != DEFAULT_MAX_LENGTH:
            logger.warning(
                "this processor was saved with a max_length of its own, which is now a call option: pass "
                f"max_length= when calling it (the default is {DEFAULT_MAX_LENGTH})"
            )
        return super().from_args_and_dict(args, processor_dict, **kwargs)

    @property
    def video_processor(self) -> MoEmbVideoProcessor:
        # Built on access, not stored: ProcessorMixin would save and load a stored one with AutoVideoProcessor,
        # whose Qwen3-VL class needs torchvision.
        return MoEmbVideoProcessor(self.image_processor)

    @property
    def model_input_names(self) -> list[str]:
        return [
            "input_ids", "attention_mask", "mm_token_type_ids", "pooled_index", "pixel_values", "image_grid_thw",
            "pixel_values_videos", "video_grid_thw",
        ]  # fmt: skip

    @property
    def unused_input_names(self) -> list[str]:
        # The timestamps are written into the prompt; the model does not take them.
        return ["video_seconds"]

    def __call__(
        self,
        images: ImageInput | None = None,
        text: TextInput | list[TextInput] | None = None,
        videos: VideoInput | None = None,
        *,
        queries: list | None = None,
        targets: list | None = None,
        **kwargs: Unpack[ProcessingKwargs],
    ):
        """
        Process a list of inputs (dicts or strings, see the module docstring, passed as the first argument) into one
        batch, `queries` and `targets` into `{"query": batch, "target": batch}`, or prompts written beforehand
        (`text`) with their `images` and `videos`, as transformers' processors do.
        """
        if queries is not None or targets is not None or (
            text is None and videos is None and images is not None and not is_image_input(images)
        ):
            return self._embedding_inputs(images, queries, targets, text, videos, **kwargs)
        inputs = super().__call__(images=images, text=text, videos=videos, **kwargs)
        if "input_ids" in inputs:
            inputs["pooled_index"] = [last_real_token(np.asarray(row)) for row in inputs["attention_mask"]]
        # pooled_index joins the other outputs in the tensor type asked for, flat or in text_kwargs or common_kwargs.
        text_kwargs = self._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs)["text_kwargs"]
        return BatchFeature(
            dict(inputs), tensor_type=text_kwargs.get("return_tensors"), skip_tensor_conversion=self.skip_tensor_conversion
        )

    def _embedding_inputs(self, inputs, queries, targets, text, videos, **options) -> BatchFeature | dict:
        """MoEMB's own API (see the class docstring): `inputs` is the list given as first argument."""
        if text is not None or videos is not None:
            raise ValueError(
                "pass either MoEMB's inputs (a list of texts and dicts, or queries= and targets=) or transformers' "
                "text=, images= and videos=, not both"
            )
        unknown = sorted(set(options) - set(EMBEDDING_OPTIONS))
        if unknown:
            raise ValueError(
                f"MoEmbProcessor has no option {', '.join(unknown)}: pass a list of inputs, each a text or a dict "
                f"with keys among {', '.join(INPUT_KEYS)} (processor(['a cat', {{'images': [image]}}])), or queries= "
                f"and targets=; their options are {', '.join(EMBEDDING_OPTIONS)}"
            )
        if (inputs is None) == (queries is None and targets is None):
            raise ValueError("pass either a list of inputs, or queries= and/or targets=")
        options = EMBEDDING_OPTIONS | options
        if inputs is not None:
            return self._batch(inputs, **options)
        sides = {"query": queries, "target": targets}
        return {side: self._batch(items, **options) for side, items in sides.items() if items is not None}

    # --- transformers' placeholders -------------------------------------------------------------------------------

    def prepare_inputs_layout(self, images=None, text=None, videos=None, audio=None, **kwargs):
        images, text, videos, audio = super().prepare_inputs_layout(images, text, videos, audio, **kwargs)
        if text is not None:
            # A video's steps bring their own vision start and end (`video_block`): the template's pair around the
            # placeholder goes, as qwen-vl-utils and the original Qwen3-VL processor do (spec A-34).
            text = [sample.replace(VISION_START + VIDEO_TOKEN + VISION_END, VIDEO_TOKEN) for sample in text]
        return images, text, videos, audio

    def _process_videos(self, videos, **kwargs):
        return super()._process_videos(make_list_of_videos(videos), **kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        return IMAGE_TOKEN * int(image_inputs["image_grid_thw"][image_idx].prod() // self.image_processor.merge_size**2)

    def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
        grid = video_inputs["video_grid_thw"][video_idx].tolist()
        return self.video_block(grid, video_inputs["video_seconds"][video_idx])

    def _get_num_multimodal_tokens(self, image_sizes=None, video_sizes=None, **kwargs) -> MultiModalData:
        """
        The number of placeholder tokens of images of `image_sizes` ((height, width) pairs) and videos of
        `video_sizes` ((num_frames, height, width)), processed with the call options `kwargs`: what vLLM sizes its
        placeholders by. A video's count is of its `<|video_pad|>` tokens, without its timestamps.
        """
        merged_kwargs = self._merge_kwargs(**kwargs)
        merge_length = self.image_processor.merge_size**2
        vision_data = {}
        if image_sizes is not None:
            images_kwargs = merged_kwargs["images_kwargs"]
            num_image_patches = [
                self.image_processor.get_number_of_image_patches(*size, images_kwargs) for size in image_sizes
            ]
            vision_data["num_image_patches"] = num_image_patches
            vision_data["num_image_tokens"] = [patches // merge_length for patches in num_image_patches]
        if video_sizes is not None:
            videos_kwargs = merged_kwargs["videos_kwargs"]
            vision_data["num_video_tokens"] = [
                self.video_processor.get_num_of_video_patches(*size, videos_kwargs) // merge_length
                for size in video_sizes
            ]
        return MultiModalData(**vision_data)

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
                self._tokenize(item, item_image_tokens, item_video_blocks, max_length or DEFAULT_MAX_LENGTH, index)
            )

        text = self.tokenizer.pad(
            {"input_ids": input_ids}, padding=True, padding_side=padding_side, return_tensors="np"
        )
        data["input_ids"], data["attention_mask"] = text["input_ids"], text["attention_mask"]
        data["mm_token_type_ids"] = np.array(self.create_mm_token_type_ids(text["input_ids"]))
        data["pooled_index"] = np.array([last_real_token(row) for row in text["attention_mask"]])
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
