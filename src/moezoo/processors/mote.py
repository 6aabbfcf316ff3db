"""Processors for MoTE (spec mote.md §6): GLM-OCR-MoTE images, VideoLLM-MoTE videos, and the task routes of both.

MoTE routes every sample through one task expert, chosen by the integer `task_ids[b]` the models take. The processors
produce it from task names, mapped through the model's expert list (`expert_names`, saved with the processor), or
from the user prompt with a `MoteRouteSelector` (spec §2.4). Without either, `task_ids` is left out and the model uses
its default route.

- [`GlmOcrMoteProcessor`]: GLM-OCR's image processing (`Glm46VImageProcessorPil`: smart resize to multiples of
  `patch_size * merge_size`, CLIP normalisation, patches in merge-block order) and its `<|image|>` placeholders.
  transformers' `Glm46VProcessor` also needs a video processor, which needs torchvision; this image-only processor
  reuses its image methods and does not (spec §2.6, §6.3).
- [`VideoLlmMoteFrameProcessor`]: VideoLLM-online's frames: resampled to 2 fps (the source frame nearest to each
  `k / fps` seconds), at most the 1,200 most recent, letterboxed to 384 x 384 and normalised with mean = std = 0.5
  (spec §6.1). PIL and numpy only: transformers' video processors need torchvision.
- [`VideoLlmMoteProcessor`]: the frame processor with a Llama-3 tokenizer and the chat template of the paper's
  appendix A.5; every frame becomes 10 `<v>` placeholders, frames are separated by `,`; a still image is a one-frame
  video.

Both are transformers processors (`__call__(images, text, videos, audio, **kwargs)`, options merged by
`ProcessorMixin._merge_kwargs`, chat templates, placeholder counts for `_get_num_multimodal_tokens`) and pass its
common processor tests (`tests/test_conformance_processors_mote.py`).

The A.5 task prompts (`task_prompt`), answer formats (`format_answer`) and GLM-OCR-MoTE's prompts (`GLM_OCR_PROMPTS`,
`kie_prompt`) are here too, so that data sets, training and evaluation render exactly what the models read and write.

This file is copied as is into exported Hub folders, where moezoo is not installed: besides the standard library,
numpy and transformers it imports only from `inputs.py`, which is copied beside it.
"""

import math

import numpy as np
from transformers.audio_utils import AudioInput
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import ImageInput, PILImageResampling, SizeDict, make_flat_list_of_images
from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorKwargs
from transformers.models.glm46v.processing_glm46v import Glm46VProcessor
from transformers.processing_utils import ImagesKwargs, MultiModalData, ProcessingKwargs, Unpack
from transformers.tokenization_utils_base import TextInput
from transformers.utils import logging
from transformers.video_utils import VideoInput

from .inputs import ChecksInputs, check_texts, describe, is_frame, make_list_of_videos


logger = logging.get_logger(__name__)

IGNORE_INDEX = -100  # labels of unsupervised positions


# --- task prompts (paper appendix A.5, identical to VideoLLM-online's COIN benchmark strings) ------------------------

VIDEOLLM_SYSTEM_PROMPT = (
    "A multimodal AI assistant is helping users with some activities. Below is their conversation, interleaved with "
    "the list of video frames received by the assistant."
)
_CONCISE = "Format your answer concisely. No extra text output."
_LISTED = "Format your answer concisely, listing each action on a new line with a number prefix. No extra text output."
COIN_TASK_PROMPTS = {
    "step": f"What is the action in the video? {_CONCISE}",
    "next": f"What is the next action for the video? {_CONCISE}",
    "task": f"What is the overall activity in the video? {_CONCISE}",
    "proc": f"What is the next {{num_steps}} actions for the video? {_LISTED}",
    "proc_plus": f"To {{goal}}, what is the next {{num_steps}} actions for the video? {_LISTED}",
    "ego4d_narration": (
        "Please concisely narrate the video in real time. Use the tag 'C' to denote the camera wearer, and other "
        "letter tags, such as 'X', to denote other individuals in the scene."
    ),
}
# Procedure forecasting over a single future step falls back to the single-step wording, as in VideoLLM-online; the
# route stays `proc` / `proc_plus` (spec §6.2, §10 A13).
SINGLE_STEP_PROMPTS = {
    "proc": COIN_TASK_PROMPTS["next"],
    "proc_plus": f"To {{goal}}, what is the next action for the video? {_CONCISE}",
}
PROCEDURE_TASKS = ("proc", "proc_plus")
# The GLM-OCR SDK's task prompts; its `ocr` route answers all three.
GLM_OCR_PROMPTS = ("Text Recognition:", "Table Recognition:", "Formula Recognition:")
# The key fields of SROIE task 3, which GLM-OCR-MoTE's `kie` route extracts.
SROIE_FIELDS = ("company", "date", "address", "total")


def task_prompt(task: str, num_steps: int | None = None, goal: str | None = None) -> str:
    """
    The user prompt of a VideoLLM-MoTE task (paper A.5).

    Args:
        task: `step`, `next`, `task`, `proc`, `proc_plus` or `ego4d_narration`.
        num_steps: For `proc` and `proc_plus`, the number of future steps asked for (VideoLLM-online uses up to 5).
        goal: For `proc_plus`, the task goal as written in the data set ("Make french fries").
    """
    if task not in COIN_TASK_PROMPTS:
        raise ValueError(f"No A.5 prompt for task {task!r}; the tasks are {', '.join(COIN_TASK_PROMPTS)}.")
    if task not in PROCEDURE_TASKS:
        return COIN_TASK_PROMPTS[task]
    if num_steps is None or num_steps < 1:
        raise ValueError(f"Task {task!r} needs num_steps >= 1 (the number of future steps), got {num_steps!r}.")
    if task == "proc_plus" and not goal:
        raise ValueError("Task 'proc_plus' needs the task goal (goal='Make french fries').")
    template = SINGLE_STEP_PROMPTS[task] if num_steps == 1 else COIN_TASK_PROMPTS[task]
    return template.format(num_steps=num_steps, goal=goal)


def kie_prompt(fields: tuple[str, ...] = SROIE_FIELDS) -> str:
    """
    The `kie` route's prompt, a JSON-schema instruction listing the fields to extract (the paper does not give its
    prompt; spec §6.2). The answer is a JSON object with these keys.
    """
    schema = ", ".join(f'"{field}": ""' for field in fields)
    return f"Information Extraction: fill in the fields of this receipt as JSON: {{{schema}}}"


def format_answer(task: str, labels: list[str]) -> str:
    """
    The target text of a COIN task (A.5): "Label." for one label; "1. A.\\n2. B." for `proc` and `proc_plus` over
    several steps. Labels start with a capital letter, as in the paper.
    """
    if not labels:
        raise ValueError("format_answer needs at least one label.")
    sentences = [label[:1].upper() + label[1:] + "." for label in labels]
    if task in PROCEDURE_TASKS and len(labels) > 1:
        return "\n".join(f"{number}. {sentence}" for number, sentence in enumerate(sentences, start=1))
    if len(labels) > 1:
        raise ValueError(f"Task {task!r} answers with one label, got {len(labels)}.")
    return sentences[0]


# --- task routes ----------------------------------------------------------------------------------------------------


class MoteRoutingMixin:
    """
    Turns task names, or a route selector, into the `task_ids` a MoTE model takes, and answers into the tokens a model
    is trained to generate. Needs `self.expert_names` (route id -> expert name, the model's `mote_expert_names`),
    `self.tokenizer`, `self.answer_prefix` (what separates the generation prompt from the answer) and
    `self.user_prompt(text)`.
    """

    def route_ids(self, task, route_selector, texts: list[str]) -> list[int] | None:
        """
        One route id per text: from `task` (a name for the whole batch or one name per text), else from
        `route_selector` applied to the user prompt of every text, else None (the model's default route). A
        processor whose `expert_names` is empty serves a dense baseline: every task takes its one path (None).
        """
        if (task is None and route_selector is None) or self.expert_names == []:
            return None
        if task is None:
            if not (hasattr(route_selector, "select") and hasattr(route_selector, "names")):
                raise ValueError(
                    f"`route_selector` is {describe(route_selector)}; pass a MoteRouteSelector, or the task name as "
                    "task=."
                )
            selected = route_selector.select([self.user_prompt(text) for text in texts])
            names = [route_selector.names[index] for index in selected.tolist()]
        elif isinstance(task, str):
            names = [task] * len(texts)
        elif isinstance(task, (list, tuple)) and all(isinstance(name, str) for name in task):
            names = list(task)
        else:
            raise ValueError(
                f"`task` is {describe(task)}; pass a task name, or a list of one name per text, among "
                f"{self.expert_names} (names, not route ids)."
            )
        if len(names) != len(texts):
            raise ValueError(f"Got {len(names)} task names for {len(texts)} texts: pass one name, or one per text.")
        expert_names = list(self.expert_names or ())
        unknown = sorted(set(names) - set(expert_names))
        if unknown:
            raise ValueError(
                f"Unknown task {', '.join(map(repr, unknown))}: this processor's experts are {expert_names}. Use one "
                "of them, or update `processor.expert_names` after adding an expert to the model."
            )
        return [expert_names.index(name) for name in names]

    def text_route_ids(self, text, task, route_selector) -> list[int] | None:
        """`route_ids` of a processor call's `text` (a prompt or a list of them). Without text there is nothing to
        route: `task` and `route_selector` are then refused, and the call returns no `task_ids`."""
        if text is None:
            if task is not None or route_selector is not None:
                raise ValueError("`task` and `route_selector` route texts: pass the prompt as text= too.")
            return None
        return self.route_ids(task, route_selector, as_text_list(text))

    def answer_ids(self, answers: list[str]) -> list[list[int]]:
        """
        The token ids a model must generate after the generation prompt for each answer, end-of-turn token included:
        the supervised positions of training (spec §3.1; `labels` are -100 everywhere else).
        """
        return [
            self.tokenizer(self.answer_prefix + answer, add_special_tokens=False)["input_ids"]
            + [self.tokenizer.eos_token_id]
            for answer in answers
        ]


def add_task_ids(inputs: BatchFeature, route_ids: list[int] | None, return_tensors) -> BatchFeature:
    if route_ids is not None:
        inputs.update(BatchFeature({"task_ids": route_ids}, tensor_type=return_tensors))
    return inputs


def warn_if_audio(audio, processor) -> None:
    """transformers' processors take `audio` whatever their model; a MoTE model hears nothing, so it is dropped."""
    if audio is not None:
        logger.warning_once(f"{type(processor).__name__} ignores `audio`: MoTE models take no audio.")


def as_text_list(text) -> list[str]:
    check_texts(text)
    return [text] if isinstance(text, str) else list(text)


# --- GLM-OCR-MoTE ---------------------------------------------------------------------------------------------------

# A GLM-V chat template for the tiny presets; converted checkpoints keep GLM-OCR's own `chat_template.jinja`.
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


class GlmOcrMoteProcessorKwargs(ProcessingKwargs, total=False):
    images_kwargs: Glm46VImageProcessorKwargs


class GlmOcrMoteProcessor(ChecksInputs, MoteRoutingMixin):
    r"""
    Processor for GLM-OCR-MoTE: GLM-OCR's image processor and tokenizer, images only, plus task routes.

    `processor(images=..., text=..., task="kie", return_tensors="pt")` returns what the model takes: `input_ids` and
    `attention_mask`, with every `<|image|>` of the text expanded to the image's `(h / merge) * (w / merge)` tokens;
    `pixel_values (patches, 3 * temporal_patch_size * patch_size**2)` and `image_grid_thw (images, 3)`;
    `mm_token_type_ids` (1 on image tokens), which the model's 3-D rotary positions need; and `task_ids` when a task
    or a route selector is given. `text` must hold one `<|image|>` per image ([`render_prompt`] writes them); texts,
    images and options are checked as in every processor of the zoo (see `inputs.py`).

    It processes images exactly as transformers' `Glm46VProcessor` (GLM-OCR's processor), whose image methods it
    reuses. It is not a subclass: `Glm46VProcessor` requires a video processor, which needs torchvision, and carries
    its defaults (spec §2.6, §6.3). Options go to the image processor or the tokenizer, flat or grouped
    (`images_kwargs={...}`, `text_kwargs={...}`), as in transformers' processors.

    Args:
        image_processor ([`Glm46VImageProcessorPil`]):
            GLM-OCR's image processor (PIL backend; loaded as `Glm46VImageProcessor` where torchvision exists).
        tokenizer ([`PreTrainedTokenizerBase`]):
            GLM-OCR's tokenizer, with `<|image|>`, `<|begin_of_image|>` and `<|end_of_image|>`.
        chat_template (`str`, *optional*):
            The GLM-V chat template (`[gMASK]<sop><|user|>\n...<|assistant|>\n`).
        expert_names (`list[str]`, *optional*):
            Route id -> task name, as the model's `mote_expert_names` (e.g. `["ocr", "kie"]`).
    """

    valid_processor_kwargs = GlmOcrMoteProcessorKwargs
    return_mm_token_type_ids = True  # the model's 3-D rotary positions need them
    text_kwargs = {"return_token_type_ids": False}
    answer_prefix = ""  # GLM answers start right after "<|assistant|>\n"

    # GLM-OCR's image placeholders and their count, as transformers computes them.
    replace_image_token = Glm46VProcessor.replace_image_token
    _get_num_multimodal_tokens = Glm46VProcessor._get_num_multimodal_tokens
    post_process_image_text_to_text = Glm46VProcessor.post_process_image_text_to_text

    def __init__(self, image_processor, tokenizer, chat_template=None, expert_names=None):
        self.image_token = "<|image|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.expert_names = list(expert_names) if expert_names is not None else None

    def __call__(
        self,
        images: ImageInput | None = None,
        text: TextInput | list[TextInput] | None = None,
        videos: VideoInput | None = None,
        audio: AudioInput | None = None,
        task: str | list[str] | None = None,
        route_selector=None,
        **kwargs: Unpack[GlmOcrMoteProcessorKwargs],
    ) -> BatchFeature:
        """
        Process images and text like GLM-OCR, then add `task_ids` (see [`MoteRoutingMixin.route_ids`]). `text` must
        hold one `<|image|>` per image (use [`render_prompt`] or `apply_chat_template`). `audio` is accepted, as by
        every transformers processor, and ignored with a warning: the model takes no audio.
        """
        if videos is not None:
            raise ValueError(
                "GLM-OCR-MoTE's processor takes images only (GLM-OCR's video processor needs torchvision); pass video "
                "frames as images."
            )
        route_ids = self.text_route_ids(text, task, route_selector)
        warn_if_audio(audio, self)
        inputs = super().__call__(images=images, text=text, **kwargs)
        return add_task_ids(inputs, route_ids, self._merge_kwargs(**kwargs)["text_kwargs"].get("return_tensors"))

    def validate_inputs(self, images=None, text=None, **kwargs):
        # transformers counts the placeholders too, but does not say how to write them.
        num_images = 0 if images is None else len(make_flat_list_of_images(images))
        num_placeholders = 0 if text is None else sum(prompt.count(self.image_token) for prompt in text)
        if text is not None and num_placeholders != num_images:
            raise ValueError(
                f"The total number of {self.image_token} tokens in the prompts should be the same as the number of "
                f"images, but the text holds {num_placeholders} {self.image_token} placeholder(s) for {num_images} "
                f"image(s): write one per image, e.g. with processor.render_prompt(prompt, num_images={num_images}) or "
                "the chat template."
            )
        super().validate_inputs(images=images, text=text, **kwargs)

    def render_prompt(self, prompt: str, num_images: int = 1) -> str:
        """A user turn with `num_images` images followed by `prompt`, and the generation prompt."""
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]
        return self.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    def user_prompt(self, text: str) -> str:
        """The text of the last user turn without its images: what the route selector reads (spec §2.4)."""
        turn = text.rsplit("<|user|>", 1)[-1].split("<|assistant|>", 1)[0]
        while "<|begin_of_image|>" in turn:
            before, _, rest = turn.partition("<|begin_of_image|>")
            turn = before + rest.partition("<|end_of_image|>")[2]
        return turn.strip()

    @property
    def model_input_names(self) -> list[str]:
        return super().model_input_names + ["mm_token_type_ids", "task_ids"]


# --- VideoLLM-MoTE frames -------------------------------------------------------------------------------------------


class VideoLlmMoteFrameProcessorKwargs(ImagesKwargs, total=False):
    r"""
    fps (`float`, *optional*, defaults to `self.fps`):
        Frames per second the videos are resampled to (the paper's 2).
    max_num_frames (`int`, *optional*, defaults to `self.max_num_frames`):
        Most frames kept per video; longer videos keep their most recent frames (the paper's 1,200 = 10 min).
    do_sample_frames (`bool`, *optional*, defaults to `self.do_sample_frames`):
        Whether to resample the videos to `fps`; `False` keeps every frame given (still at most `max_num_frames`).
    num_frames (`int`, *optional*):
        Sample this many frames evenly over each video instead of resampling it to `fps` (transformers' uniform
        sampling; VideoLLM-MoTE was trained on `fps` streams).
    """

    fps: int | float | None
    max_num_frames: int | None
    do_sample_frames: bool | None
    num_frames: int | None


def sample_frame_indices(
    num_source_frames: int,
    fps: float,
    source_fps: float | None = None,
    timestamps: list[float] | None = None,
    segment: tuple[float, float] | None = None,
    max_num_frames: int | None = None,
) -> list[int]:
    """
    Indices of the source frames that make a `fps` stream: for every `k` with `k / fps` within the video, the source
    frame nearest to `k / fps` seconds (the earlier one on a tie).

    Source frame `i` is at `timestamps[i]`, else at `i / source_fps`; without either, the frames already are the
    `fps` stream. A `segment = (start, end)` in seconds keeps stream frames `ceil(start * fps)` to `ceil(end * fps)`,
    both included, as for COIN step segments. Beyond `max_num_frames`, the most recent frames are kept (spec §10, A15).
    """
    if num_source_frames < 1:
        raise ValueError("A video needs at least one frame.")
    if timestamps is not None:
        times = np.asarray(timestamps, dtype=np.float64)
        if times.shape != (num_source_frames,) or np.any(np.diff(times) < 0):
            raise ValueError(
                f"Expected {num_source_frames} non-decreasing timestamps (one per frame), got {len(timestamps)}: "
                f"{list(timestamps)[:8]}..."
            )
    else:
        rate = fps if source_fps is None else source_fps
        if rate <= 0:
            raise ValueError(f"The source fps must be positive, got {rate}.")
        times = np.arange(num_source_frames) / rate
    # A small tolerance keeps frames whose time is k / fps up to floating-point error.
    first, last = math.ceil(times[0] * fps - 1e-6), math.floor(times[-1] * fps + 1e-6)
    if segment is not None:
        start, end = segment
        if end < start:
            raise ValueError(f"A segment must have start <= end, got {segment}.")
        first, last = max(first, math.ceil(start * fps - 1e-6)), min(last, math.ceil(end * fps - 1e-6))
    if last < first:
        raise ValueError(
            f"No {fps} fps frame falls within the video ({times[0]:.2f} s to {times[-1]:.2f} s)"
            + (f" and the segment {segment}" if segment is not None else "")
            + "."
        )
    targets = np.arange(first, last + 1) / fps
    if num_source_frames == 1:
        indices = [0] * len(targets)
    else:
        after = np.clip(np.searchsorted(times, targets), 1, num_source_frames - 1)
        before = after - 1
        indices = np.where(np.abs(times[after] - targets) < np.abs(targets - times[before]), after, before).tolist()
    return indices[-max_num_frames:] if max_num_frames is not None else indices


def letterbox_size(height: int, width: int, box_height: int, box_width: int) -> tuple[int, int]:
    """The size of an image scaled, aspect ratio kept, to fit `box_height` x `box_width` with one side filling it."""
    scale = min(box_height / height, box_width / width)
    return max(1, min(box_height, round(height * scale))), max(1, min(box_width, round(width * scale)))


def per_video(value, num_videos: int, name: str) -> list:
    """`value` for every video: a list with one entry per video, or one value (None included) shared by all. (Per-video
    timestamps are lists themselves, so they always come as a list of lists.)"""
    if isinstance(value, list):
        if len(value) != num_videos:
            raise ValueError(f"`{name}` has {len(value)} entries for {num_videos} videos: pass one per video.")
        return value
    return [value] * num_videos


# How frames are chosen; the other options of the frame processor are image options.
SAMPLING_OPTIONS = ("fps", "max_num_frames", "do_sample_frames", "num_frames")


class VideoLlmMoteFrameProcessor(PilBackend):
    r"""
    Frame sampling and preprocessing of VideoLLM-MoTE (VideoLLM-online's), on transformers' PIL/numpy backend.

    Videos are decoded frames (a list of PIL images or arrays, or a `(frames, height, width, channels)` array), one
    video or a list of them; a frame alone is a still image, a one-frame video. Each is resampled to `fps` with
    [`sample_frame_indices`] (or, with `do_sample_frames=False`, kept frame by frame), cut to `max_num_frames`, and
    every kept frame is letterboxed: scaled (bicubic) so that its longer side fills `size`, centred on a black
    canvas of `size`, rescaled to [0, 1] and normalised with mean = std = 0.5.

    Returns `pixel_values_videos (sum of frames, 3, height, width)` float32, the frames of all videos one after the
    other, and `video_num_frames (videos,)` int64.

    Args:
        fps (`float`, *optional*, defaults to 2):
            Frames per second of the stream the model sees.
        max_num_frames (`int`, *optional*, defaults to 1200):
            Most frames per video (the most recent are kept).
        do_sample_frames (`bool`, *optional*, defaults to `True`):
            Whether to resample videos to `fps`; `False` takes the frames given as the stream.
        size (`dict[str, int]`, *optional*, defaults to `{"height": 384, "width": 384}`):
            The canvas; the vision tower's image size.
        Other arguments (`resample`, `do_rescale`, `rescale_factor`, `do_normalize`, `image_mean`, `image_std`,
        `do_convert_rgb`) work as in every transformers image processor.
    """

    valid_kwargs = VideoLlmMoteFrameProcessorKwargs
    model_input_names = ["pixel_values_videos", "video_num_frames"]

    fps = 2.0
    max_num_frames = 1200
    do_sample_frames = True
    num_frames = None
    size = {"height": 384, "width": 384}
    resample = PILImageResampling.BICUBIC
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True

    def __call__(
        self,
        videos,
        video_fps: float | list[float | None] | None = None,
        timestamps: list[list[float]] | None = None,
        segments: tuple[float, float] | list[tuple[float, float] | None] | None = None,
        return_tensors=None,
        **kwargs: Unpack[VideoLlmMoteFrameProcessorKwargs],
    ) -> BatchFeature:
        """
        Sample and process `videos`.

        Args:
            videos: One video or a list of videos (see the class docstring).
            video_fps: Frames per second of the decoded videos, one for all or one per video. Without it (and without
                `timestamps`) the frames are taken to be the `fps` stream already.
            timestamps: Per video, the time in seconds of each of its frames (for frames decoded irregularly).
            segments: `(start, end)` in seconds, one for all or one (or None) per video: the part to keep.
            kwargs: `fps`, `max_num_frames`, `do_sample_frames` and the image options, overriding this processor's
                settings.
        """
        given = {name: kwargs.pop(name, None) for name in SAMPLING_OPTIONS}
        fps, max_num_frames, do_sample_frames, num_frames = (
            getattr(self, name) if value is None else value for name, value in given.items()
        )
        if fps <= 0 or max_num_frames < 1 or (num_frames is not None and num_frames < 1):
            raise ValueError(
                f"fps must be positive, and max_num_frames and num_frames at least 1; got {fps}, {max_num_frames} and "
                f"{num_frames}."
            )
        resamples_to_fps = do_sample_frames and num_frames is None
        if not resamples_to_fps and not (video_fps is None and timestamps is None and segments is None):
            raise ValueError(
                "video_fps, timestamps and segments choose the frames of an fps stream: with do_sample_frames=False "
                "(every frame given is kept) or num_frames (frames evenly spaced), leave them out."
            )
        videos = [[videos]] if is_frame(videos) else make_list_of_videos(videos)
        frames, frames_per_video = [], []
        for video, source_fps, times, segment in zip(
            videos, per_video(video_fps, len(videos), "video_fps"), per_video(timestamps, len(videos), "timestamps"),
            per_video(segments, len(videos), "segments"),
        ):  # fmt: skip
            if resamples_to_fps:
                indices = sample_frame_indices(len(video), fps, source_fps, times, segment, max_num_frames)
            elif do_sample_frames:
                count = min(num_frames, max_num_frames, len(video))
                indices = np.linspace(0, len(video) - 1, count).round().astype(int).tolist()
            else:
                indices = list(range(len(video)))[-max_num_frames:]
            frames.extend(video[i] for i in indices)
            frames_per_video.append(len(indices))
        pixel_values = self.preprocess(frames, **kwargs)["pixel_values"]
        data = {"pixel_values_videos": pixel_values, "video_num_frames": np.array(frames_per_video, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def _preprocess(
        self,
        images: list[np.ndarray],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: tuple[float, ...],
        image_std: tuple[float, ...],
        **kwargs,
    ) -> BatchFeature:
        processed = []
        for image in images:
            if do_resize:
                image = self.letterbox(image, size, resample)
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            processed.append(image.astype(np.float32))
        if len({image.shape for image in processed}) > 1:
            raise ValueError(
                "With do_resize=False every frame must have the same size; got "
                f"{sorted({image.shape[1:] for image in processed})}."
            )
        return BatchFeature(data={"pixel_values": np.stack(processed)})

    def letterbox(self, image: np.ndarray, size: SizeDict, resample: PILImageResampling) -> np.ndarray:
        """Scale a (channels, height, width) uint8 image to fit `size` and pad it centrally with black."""
        height, width = letterbox_size(image.shape[-2], image.shape[-1], size.height, size.width)
        image = self.resize(image, SizeDict(height=height, width=width), resample=resample)
        top, left = (size.height - height) // 2, (size.width - width) // 2
        padding = ((0, 0), (top, size.height - height - top), (left, size.width - width - left))
        return np.pad(image, padding)


# --- VideoLLM-MoTE --------------------------------------------------------------------------------------------------

VIDEO_TOKEN = "<v>"  # stands for the frame placeholder token in the template below
IMAGE_TOKEN = "<image>"  # a still image in a text, expanded into one frame's placeholders


def videollm_chat_template(video_token: str, image_token: str = IMAGE_TOKEN) -> str:
    """
    VideoLLM-online's chat template (paper A.5) with `video_token` as the frame placeholder.

    Roles: `system` -> `<|begin_of_text|>` + content + `\\n`; `user` -> `\\nUser: ` + content; `stream` ->
    `\\n[` + one `video_token` + `]`, which the processor expands into the frames of its video; `assistant` ->
    `\\nAssistant: ` + content + `<|eot_id|>` (the generated span, for `return_assistant_tokens_mask`); the generation
    prompt is `\\nAssistant:`. Content is a string or transformers' list of parts: its text parts in order, then a
    stream per image (`image_token`) or video part, as a `stream` message after the user's words.
    """
    text = (
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
        "{%- endif -%}"
    )
    streams = (
        "{%- if message['content'] is not string -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}{{ '\n[" + image_token + "]' }}"
        "{%- elif part['type'] == 'video' -%}{{ '\n[" + video_token + "]' }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
    )
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}{{ bos_token }}" + text + "{{ '\n' }}"
        "{%- elif message['role'] == 'user' -%}{{ '\nUser: ' }}" + text + streams +
        "{%- elif message['role'] == 'stream' -%}{{ '\n[" + video_token + "]' }}"
        "{%- elif message['role'] == 'assistant' -%}{{ '\nAssistant: ' }}{%- generation -%}" + text + "{{ eos_token }}"
        "{%- endgeneration -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '\nAssistant:' }}{%- endif -%}"
    )


class VideoLlmMoteProcessorKwargs(ProcessingKwargs, total=False):
    images_kwargs: VideoLlmMoteFrameProcessorKwargs
    videos_kwargs: VideoLlmMoteFrameProcessorKwargs


class VideoLlmMoteProcessor(ChecksInputs, MoteRoutingMixin):
    r"""
    Processor for VideoLLM-MoTE: a [`VideoLlmMoteFrameProcessor`] for the videos and a Llama-3 tokenizer.

    `processor(text=..., videos=..., task="step", return_tensors="pt")` returns `input_ids` and `attention_mask`,
    `pixel_values_videos` and `video_num_frames` (see the frame processor) and `task_ids`. Each text holds one
    `video_token` per video, in order (a `stream` message of the chat template renders one, inside `[` `]`); it is
    expanded to the video's frames, `frame_num_tokens` placeholders per frame separated by `frame_interval_token`, so
    F frames cost `10F + (F - 1)` tokens (spec §2.7). A still image (`images=`, one `image_token` per image) is a
    one-frame video: its `image_token` becomes one frame's placeholders and its frame joins `pixel_values_videos` in
    the order of the placeholders. Texts are rendered prompts, beginning-of-text included, so the tokenizer adds no
    special tokens of its own. [`encode_stream`] builds a live-stream training example instead (answers interleaved
    with the frames, silence targets; spec §6.1).

    Options go to the frame processor (`fps`, `max_num_frames`, `do_sample_frames`, `size`, ...) or the tokenizer
    (`padding`, `truncation`, `max_length`, `return_offsets_mapping`, ...), flat or grouped (`videos_kwargs={...}`,
    `images_kwargs={...}`, `text_kwargs={...}`) as in transformers' processors; one that no part takes is an error.

    Args:
        image_processor ([`VideoLlmMoteFrameProcessor`]):
            Samples and processes the frames (transformers loads it with `AutoImageProcessor`: its video processors
            need torchvision). It is also the processor's `video_processor`.
        tokenizer ([`PreTrainedTokenizerBase`]):
            The Llama-3 tokenizer, whose `eos_token` ends assistant turns (`<|eot_id|>` for the Instruct models).
        chat_template (`str`, *optional*):
            Defaults to [`videollm_chat_template`] with `video_token` and `image_token`.
        expert_names (`list[str]`, *optional*):
            Route id -> task name, as the model's `mote_expert_names`.
        video_token (`str`, *optional*, defaults to `"<v>"`):
            The frame placeholder: a reserved special token of the vocabulary (`<|reserved_special_token_0|>` for
            Llama-3), whose id is the model's `video_token_id`.
        image_token (`str`, *optional*, defaults to `"<image>"`):
            Marks a still image in a text; it is replaced by one frame's placeholders, so it need not be a token.
        frame_interval_token (`str`, *optional*, defaults to `","`):
            Separates frames; its id is the model's `frame_token_interval_id`.
        frame_num_tokens (`int`, *optional*, defaults to 10):
            Placeholders per frame (the "CLS" token and a 3 x 3 pooled grid).
        system_prompt (`str`, *optional*):
            The system prompt [`render_prompt`] uses; VideoLLM-online's by default.
    """

    valid_processor_kwargs = VideoLlmMoteProcessorKwargs
    text_kwargs = {"add_special_tokens": False}  # rendered prompts begin with their own <|begin_of_text|>
    answer_prefix = " "  # "\nAssistant:" ends the prompt; answers follow after a space (A.5)
    response_header = "]\nAssistant:"  # closes the stream before an answer in a live stream
    stream_reopening = "\n["  # and reopens it after the answer

    def __init__(
        self,
        image_processor,
        tokenizer,
        chat_template=None,
        expert_names=None,
        video_token: str = VIDEO_TOKEN,
        image_token: str = IMAGE_TOKEN,
        frame_interval_token: str = ",",
        frame_num_tokens: int = 10,
        system_prompt: str = VIDEOLLM_SYSTEM_PROMPT,
    ):
        super().__init__(
            image_processor, tokenizer, chat_template=chat_template or videollm_chat_template(video_token, image_token)
        )
        self.expert_names = list(expert_names) if expert_names is not None else None
        self.video_token = video_token
        self.image_token = image_token
        self.frame_interval_token = frame_interval_token
        self.frame_num_tokens = frame_num_tokens
        self.system_prompt = system_prompt
        vocabulary = tokenizer.get_vocab()
        for token in (video_token, frame_interval_token):
            if token not in vocabulary:
                raise ValueError(f"The tokenizer has no token {token!r}: it must be a single token of the vocabulary.")
        self.video_token_id = vocabulary[video_token]
        self.frame_interval_token_id = vocabulary[frame_interval_token]

    @property
    def video_processor(self) -> VideoLlmMoteFrameProcessor:
        # The frame processor, under the name transformers gives the part that takes videos; not a second saved
        # component (transformers' video processors need torchvision).
        return self.image_processor

    def __call__(
        self,
        images: ImageInput | None = None,
        text: TextInput | list[TextInput] | None = None,
        videos: VideoInput | None = None,
        audio: AudioInput | None = None,
        task: str | list[str] | None = None,
        route_selector=None,
        video_fps: float | list[float | None] | None = None,
        timestamps: list[list[float]] | None = None,
        segments: tuple[float, float] | list[tuple[float, float] | None] | None = None,
        **kwargs: Unpack[VideoLlmMoteProcessorKwargs],
    ) -> BatchFeature:
        """
        Process texts with their videos and still images.

        Args:
            images: Still images, one `image_token` each in the texts: each is a one-frame video.
            text: A rendered prompt or a list of them (see [`render_prompt`]), with one `video_token` per video.
            videos: The videos of all texts in order (one video, or a list; see [`VideoLlmMoteFrameProcessor`]).
            audio: Accepted, as by every transformers processor, and ignored with a warning: the model hears nothing.
            task: A task name for the whole batch or one per text; else `route_selector` chooses from the user
                prompts; else no `task_ids` (the model's default route).
            route_selector: A `MoteRouteSelector` whose names are task names of this processor.
            video_fps, timestamps, segments: How to sample the videos (see [`VideoLlmMoteFrameProcessor`]).
            kwargs: Options of the frame processor and the tokenizer, flat or grouped by modality.

        Without text, the frames of the images come before those of the videos.
        """
        # Not ProcessorMixin.__call__: images and videos both become frames of `pixel_values_videos`, which must
        # follow the order of their placeholders in the texts.
        route_ids = self.text_route_ids(text, task, route_selector)
        images, text, videos, audio = self.prepare_inputs_layout(images=images, text=text, videos=videos, **kwargs)
        self.validate_inputs(images=images, text=text, videos=videos, **kwargs)
        warn_if_audio(audio, self)
        output_kwargs = self._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs)
        return_tensors = output_kwargs["text_kwargs"].pop("return_tensors", None)

        streams = {"image": None, "video": None}  # frames of each stream, per modality, in the order given
        replacements = {"image": [], "video": []}
        if images is not None:
            frames, replacements["image"] = self._process_images(images, **output_kwargs["images_kwargs"])
            streams["image"] = self.split_streams(frames)
        if videos is not None:
            frames, replacements["video"] = self._process_videos(
                videos, video_fps=video_fps, timestamps=timestamps, segments=segments, **output_kwargs["videos_kwargs"]
            )
            streams["video"] = self.split_streams(frames)

        data = {}
        if text is not None:
            text_kwargs = output_kwargs["text_kwargs"]
            # As ProcessorMixin.__call__: these are processor options, also accepted among the text options.
            return_offsets, return_token_types = (
                text_kwargs.pop(name, output_kwargs[name])
                for name in ("return_text_replacement_offsets", "return_mm_token_type_ids")
            )
            text, offsets = self.get_text_with_replacements(text, replacements["image"], replacements["video"])
            data.update(self.tokenizer(text, **text_kwargs))
            # Truncation can cut frame placeholders while every frame stays in `pixel_values_videos`.
            self._check_special_mm_tokens(text, data, modalities=["video"])
            order = [[replacement["type"] for replacement in sample] for sample in offsets]
            if return_offsets:
                data["text_replacement_offsets"] = offsets
            if return_token_types:
                data["mm_token_type_ids"] = self.frame_token_types(data["input_ids"], order, streams)
        else:
            order = [["image"] * len(streams["image"] or ()) + ["video"] * len(streams["video"] or ())]
        if images is not None or videos is not None:
            data.update(self.join_streams(streams, [kind for sample in order for kind in sample]))
        inputs = BatchFeature(data, tensor_type=return_tensors, skip_tensor_conversion=self.skip_tensor_conversion)
        return add_task_ids(inputs, route_ids, return_tensors)

    def validate_inputs(self, images=None, text=None, videos=None, **kwargs):
        # transformers counts the placeholders too, but does not say how to write them.
        num_videos = 0 if videos is None else len(make_list_of_videos(videos))
        num_placeholders = 0 if text is None else sum(prompt.count(self.video_token) for prompt in text)
        if text is not None and num_placeholders != num_videos:
            raise ValueError(
                f"The total number of {self.video_token} tokens in the prompts should be the same as the number of "
                f"videos, but the texts hold {num_placeholders} {self.video_token!r} placeholders for {num_videos} "
                "videos: put one `stream` message (one placeholder) per video in the conversation."
                + (f" A still image is written {self.image_token} (an `image` part of a message)." if images else "")
            )
        super().validate_inputs(images=images, text=text, videos=videos, **kwargs)

    # Frames stay numpy arrays until the streams are put in order; the output is converted as a whole.
    def _process_images(self, images: ImageInput, **kwargs) -> tuple[dict, list[str]]:
        # A still image is a one-frame video: no resampling in time.
        still_videos = [[image] for image in make_flat_list_of_images(images)]
        frames = self.image_processor(still_videos, **{**kwargs, "do_sample_frames": False, "return_tensors": None})
        return frames, [self.replace_image_token(frames, index) for index in range(len(frames["video_num_frames"]))]

    def _process_videos(self, videos: VideoInput, **kwargs) -> tuple[dict, list[str]]:
        frames = self.video_processor(videos, **{**kwargs, "return_tensors": None})
        return frames, [self.replace_video_token(frames, index) for index in range(len(frames["video_num_frames"]))]

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        return self.video_token * self.frame_num_tokens

    def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
        num_frames = int(video_inputs["video_num_frames"][video_idx])
        return self.frame_interval_token.join([self.video_token * self.frame_num_tokens] * num_frames)

    @staticmethod
    def split_streams(frames: dict) -> list[np.ndarray]:
        """The frames of each video (or image) of a frame-processor output, one array per stream."""
        boundaries = np.cumsum(frames["video_num_frames"])[:-1]
        return np.split(np.asarray(frames["pixel_values_videos"]), boundaries)

    @staticmethod
    def join_streams(streams: dict, order: list[str]) -> dict:
        """`pixel_values_videos` and `video_num_frames` of all streams, images and videos, in `order`."""
        remaining = {kind: iter(streams[kind] or ()) for kind in streams}
        ordered = [next(remaining[kind]) for kind in order]
        return {
            "pixel_values_videos": np.concatenate(ordered),
            "video_num_frames": np.array([len(frames) for frames in ordered], dtype=np.int64),
        }

    def frame_token_types(self, input_ids, order: list[list[str]], streams: dict) -> list[list[int]]:
        """
        transformers' `mm_token_type_ids`: 1 on the placeholders of an image, 2 on those of a video, 0 elsewhere.
        Both are `video_token`: the placeholders of a text belong to its streams (`order`) one after the other.
        """
        frame_counts = {kind: iter(len(frames) for frames in streams[kind] or ()) for kind in streams}
        token_types = []
        for ids, kinds in zip(input_ids, order):
            owners = [
                1 if kind == "image" else 2
                for kind in kinds
                for _ in range(next(frame_counts[kind]) * self.frame_num_tokens)
            ]
            owner = iter(owners)
            token_types.append([next(owner) if token == self.video_token_id else 0 for token in ids])
        return token_types

    def _get_num_multimodal_tokens(self, image_sizes=None, video_sizes=None, **kwargs) -> MultiModalData:
        """
        The placeholder tokens of images of `image_sizes` and of videos of `video_sizes` (frames, height, width), the
        videos' frames taken as given (their source rate is unknown here), at most `max_num_frames`: each frame costs
        `frame_num_tokens` whatever its size, since frames are letterboxed.
        """
        vision_data = {}
        if image_sizes is not None:
            vision_data["num_image_tokens"] = [self.frame_num_tokens] * len(image_sizes)
            vision_data["num_image_patches"] = [1] * len(image_sizes)  # one frame each
        if video_sizes is not None:
            max_num_frames = self._merge_kwargs(**kwargs)["videos_kwargs"].get("max_num_frames")
            max_num_frames = max_num_frames or self.image_processor.max_num_frames
            vision_data["num_video_tokens"] = [
                min(num_frames, max_num_frames) * self.frame_num_tokens for num_frames, _, _ in video_sizes
            ]
        return MultiModalData(**vision_data)

    def encode_stream(
        self,
        video,
        responses: dict[int, str],
        prompt: str,
        task=None,
        silence_token: str = "eos",
        video_fps: float | None = None,
        timestamps: list[float] | None = None,
        system_prompt: str | None = None,
        return_tensors=None,
        **frame_options,
    ) -> BatchFeature:
        """
        One streaming training example (spec §6.1, §3.1; the Ego4D narration task of VideoLLM-online): the system
        and user prompts, then the video as a live stream in which the assistant answers `responses[k]` right after
        frame `k`: `\\n[` frames `]\\nAssistant: <response><|eot_id|>\\n[` more frames ... `]`. Frame `k` is the
        `k`-th frame the frame processor keeps (at `fps`, so at `k / fps` s into the video when nothing is capped).

        `labels` supervise each response together with its `]\\nAssistant:` header and end-of-turn token (without a
        target at response frames the model could never learn to speak), and put the silence token after the last
        placeholder of every frame without a response: `silence_token="eos"` (the paper) or `"interval"` (the `,` of
        VideoLLM-online live1+), the model's `stream_silence_token`. Everything else is -100. The user prompt comes
        first; VideoLLM-online's Ego4D data may open with a stream chunk, which changes nothing the model learns.

        Returns `input_ids`, `attention_mask` and `labels` (each of one row), `pixel_values_videos`,
        `video_num_frames` and, given a `task`, `task_ids`.
        """
        frames = self.image_processor(
            [video], video_fps=video_fps, timestamps=None if timestamps is None else [timestamps], **frame_options
        )
        num_frames = int(frames["video_num_frames"][0])
        outside = sorted(k for k in responses if not 0 <= k < num_frames)
        if outside:
            raise ValueError(
                f"Responses follow frames {outside}, but the stream has {num_frames} frames (0 to {num_frames - 1}): "
                "key responses by the index of the frame they follow in the sampled stream."
            )
        silence_id = self.silence_token_id(silence_token)
        input_ids = self.stream_opening_ids(prompt, system_prompt)
        labels = [IGNORE_INDEX] * len(input_ids)
        for k in range(num_frames):
            if k > 0 and k - 1 not in responses:
                input_ids.append(self.frame_interval_token_id)
                labels.append(silence_id)  # what frame k - 1 predicts: the target sits on the token after it
            input_ids += [self.video_token_id] * self.frame_num_tokens
            labels += [IGNORE_INDEX] * self.frame_num_tokens
            if k in responses:
                response = self.text_ids(self.response_header) + self.answer_ids([responses[k]])[0]
                input_ids += response
                labels += response
                if k < num_frames - 1:
                    reopen = self.text_ids(self.stream_reopening)
                    input_ids += reopen
                    labels += [IGNORE_INDEX] * len(reopen)
        if num_frames - 1 not in responses:
            closing = self.text_ids("]")
            input_ids += closing
            labels += [silence_id] + [IGNORE_INDEX] * (len(closing) - 1)
        data = {"input_ids": [input_ids], "attention_mask": [[1] * len(input_ids)], "labels": [labels], **frames}
        inputs = BatchFeature(data=data, tensor_type=return_tensors)
        return add_task_ids(inputs, self.route_ids(task, None, [prompt]), return_tensors)

    def stream_opening_ids(self, prompt: str, system_prompt: str | None = None) -> list[int]:
        """What opens a live stream: the system and user prompts, then the stream's opening bracket."""
        system = self.system_prompt if system_prompt is None else system_prompt
        opening = self.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": prompt}])
        return self.text_ids(opening + self.stream_reopening)

    def silence_token_id(self, silence_token: str) -> int:
        """The id a silent frame predicts: `"eos"` -> the end-of-turn token, `"interval"` -> the frame separator."""
        ids = {"eos": self.tokenizer.eos_token_id, "interval": self.frame_interval_token_id}
        if silence_token not in ids:
            raise ValueError(f"silence_token={silence_token!r} is not one of {sorted(ids)}")
        return ids[silence_token]

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render_prompt(self, prompt: str, system_prompt: str | None = None) -> str:
        """The COIN layout of A.5: system prompt, user prompt, the video stream, then the generation prompt."""
        messages = [
            {"role": "system", "content": self.system_prompt if system_prompt is None else system_prompt},
            {"role": "user", "content": prompt},
            {"role": "stream"},
        ]
        return self.apply_chat_template(messages, add_generation_prompt=True)

    def user_prompt(self, text: str) -> str:
        """The last user turn of a rendered text: what the route selector reads (spec §2.4)."""
        return text.rsplit("\nUser: ", 1)[-1].split("\n", 1)[0].strip()

    @property
    def model_input_names(self) -> list[str]:
        return self.tokenizer.model_input_names + self.image_processor.model_input_names + ["task_ids"]


__all__ = [
    "GlmOcrMoteProcessor",
    "VideoLlmMoteFrameProcessor",
    "VideoLlmMoteProcessor",
    "format_answer",
    "kie_prompt",
    "sample_frame_indices",
    "task_prompt",
]
