"""Processor for MoE-ViE: images, videos and CLIP text in the NaFlex format the model consumes.

MoE-ViE's vision tower takes pre-patchified images, as Siglip2 does, so one code path serves fixed-size and
variable-size inputs:

- `pixel_values (B, N_max, p * p * 3)` float32, every patch flattened in (py, px, channel) order;
- `pixel_attention_mask (B, N_max)` int32, 1 for real patches and 0 for padding slots;
- `spatial_shapes (B, 2)` int64, the (rows, cols) patch grid of each image.

Three resize policies produce them (`resize_mode`):

- `"square"` (official): squash the image to `size` x `size` with bicubic resampling.
- `"center_crop"`: resize the shorter side to `size`, then crop the centre `size` x `size` square.
- `"naflex"`: keep the aspect ratio, at most `max_num_patches` patches (Siglip2's policy).

After resizing, pixels are rescaled to [0, 1] and normalised with mean = std = 0.5. When `size` is not a multiple of
the patch size, the normalised image is zero-padded centrally to the next multiple, as the official transform does.

Videos are lists of frames: `num_frames` frames are sampled uniformly (or, with `do_sample_frames=False`, all are kept)
and each one goes through the image pipeline. The image processor is also the frame processor: it saves the frame
settings with its other settings, and per-call options override them, as for every image option.
Text uses a CLIP BPE tokenizer (`CLIPTokenizer`); see `tiny_tokenizers.py` for one built offline for tests.

This file is copied as is into exported Hub folders, where moezoo is not installed: it must import only the standard
library, numpy and transformers, and nothing that needs torchvision.
"""

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import (
    ChannelDimension,
    ImageInput,
    PILImageResampling,
    SizeDict,
    is_pil_image,
)
from transformers.models.siglip2.image_processing_pil_siglip2 import (
    convert_image_to_patches,
    get_image_size_for_max_num_patches,
    pad_along_first_dim,
)
from transformers.processing_utils import ImagesKwargs, ProcessingKwargs, Unpack

from .inputs import SUPPORTED_NUM_CHANNELS, ChecksInputs, check_images, make_list_of_videos

RESIZE_MODES = ("square", "center_crop", "naflex")


class MoeVieImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    resize_mode (`str`, *optional*, defaults to `self.resize_mode`):
        `"square"`, `"center_crop"` or `"naflex"` (see the module docstring).
    patch_size (`int`, *optional*, defaults to `self.patch_size`):
        Side of the square patches the image is cut into.
    max_num_patches (`int`, *optional*, defaults to `self.max_num_patches`):
        Patch budget of `"naflex"` mode; every image is padded to exactly this many patches. Unused by other modes.
    """

    # A plain `str`, not a `Literal`: the typed-dict validator would reject unknown values with an error that does not
    # list the valid modes, so `check_resize_mode` does it.
    resize_mode: str
    patch_size: int
    max_num_patches: int


class MoeVieVideosKwargs(MoeVieImageProcessorKwargs, total=False):
    r"""
    num_frames (`int`, *optional*, defaults to the image processor's `num_frames`):
        Number of frames sampled uniformly from each video.
    do_sample_frames (`bool`, *optional*, defaults to the image processor's `do_sample_frames`):
        Whether to sample `num_frames` frames; `False` keeps every frame of each video.
    """

    num_frames: int
    do_sample_frames: bool


def check_resize_mode(resize_mode: str) -> None:
    """Raise a `ValueError` naming the valid modes when `resize_mode` is not one of them."""
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"Unknown resize_mode {resize_mode!r}: use one of {', '.join(map(repr, RESIZE_MODES))}.")


def infer_channel_layout(shape: tuple[int, ...], input_data_format: str | ChannelDimension | None) -> ChannelDimension:
    """
    Return the channel layout of a numpy or torch image of shape `shape`, checking its channel count.

    transformers guesses "channels first" when both ends of the shape could be channels: a user error that deserves an
    explanation, so it raises here. (`check_images` has already refused shapes without a channel axis at either end.)
    """
    if input_data_format is not None:
        layout = ChannelDimension(input_data_format)
        num_channels = shape[0] if layout == ChannelDimension.FIRST else shape[-1]
        if num_channels not in SUPPORTED_NUM_CHANNELS:
            raise ValueError(
                f"An image of shape {tuple(shape)} with input_data_format={layout.value!r} has {num_channels} "
                f"channels; only {SUPPORTED_NUM_CHANNELS} (greyscale, RGB, RGBA) are supported."
            )
        return layout
    channels_first = shape[0] in SUPPORTED_NUM_CHANNELS
    if channels_first and shape[-1] in SUPPORTED_NUM_CHANNELS:
        raise ValueError(
            f"The channel axis of an image of shape {tuple(shape)} is ambiguous: both its first and last axes could "
            "hold the channels. Pass input_data_format='channels_last' for (height, width, channels) arrays or "
            "'channels_first' for (channels, height, width) ones."
        )
    return ChannelDimension.FIRST if channels_first else ChannelDimension.LAST


def pad_to_patch_multiple(image: np.ndarray, patch_size: int) -> np.ndarray:
    """
    Zero-pad a (channels, height, width) image centrally so that both sides are multiples of `patch_size`.

    The official transform pads after normalisation, so the padding is 0 in normalised units (mid-grey), and puts the
    odd pixel, if any, at the bottom and right. Images smaller than one patch are rejected: padding them would give a
    patch made mostly of padding.
    """
    _, height, width = image.shape
    if height < patch_size or width < patch_size:
        raise ValueError(
            f"An image is {height}x{width} pixels after resizing, smaller than one {patch_size}x{patch_size} patch. "
            f"Use a `size` of at least {patch_size} pixels (or, with do_resize=False, larger images)."
        )
    pad_height, pad_width = -height % patch_size, -width % patch_size
    if pad_height == pad_width == 0:
        return image
    padding = ((0, 0), (pad_height // 2, pad_height - pad_height // 2), (pad_width // 2, pad_width - pad_width // 2))
    return np.pad(image, padding)


def sample_frame_indices(num_total_frames: int, num_frames: int) -> list[int]:
    """
    Indices of `num_frames` frames spread uniformly over a video of `num_total_frames` frames, first and last included.

    Index i is `int(i * (T - 1) / (n - 1))`, the floored linspace of `PeVideoVideoProcessor.sample_frames`, computed
    in integers so it is exact. Shorter videos keep all their frames (the processor pads them) instead of repeating
    some, so that every frame the model sees is distinct.
    """
    if num_total_frames <= num_frames:
        return list(range(num_total_frames))
    # With num_frames == 1 the linspace degenerates to its start, frame 0.
    return [i * (num_total_frames - 1) // max(num_frames - 1, 1) for i in range(num_frames)]


class MoeVieImageProcessor(PilBackend):
    r"""
    Image processor for MoE-ViE, on transformers' PIL/numpy backend (no torchvision needed).

    Accepts PIL images, numpy arrays and torch tensors, (height, width, channels) or (channels, height, width), with 1,
    3 or 4 channels (converted to RGB; transparent pixels are composited onto white, as in every transformers
    processor). Returns `pixel_values`, `pixel_attention_mask` and `spatial_shapes` (see the module docstring).
    `N_max` is `max_num_patches` in `"naflex"` mode, as in Siglip2, and otherwise the largest patch grid of the batch
    (all images share one grid unless `do_resize=False`).

    Args:
        resize_mode (`str`, *optional*, defaults to `"square"`):
            `"square"` (official), `"center_crop"` or `"naflex"`.
        size (`int` or `dict[str, int]`, *optional*, defaults to `{"height": 224, "width": 224}`):
            Target size S of the `"square"` and `"center_crop"` modes; override it per call for progressive-resolution
            training (`processor(images, size=112)`). A non-square `{"height": h, "width": w}` squashes to (h, w), or
            resizes the shorter side to max(h, w) and crops (h, w).
        patch_size (`int`, *optional*, defaults to 16):
            Side of the square patches.
        max_num_patches (`int`, *optional*, defaults to 256):
            Patch budget of the `"naflex"` mode.
        resample (`PILImageResampling`, *optional*, defaults to `PILImageResampling.BICUBIC`):
            Resampling filter (the official transform uses bicubic).
        image_mean, image_std (`list[float]`, *optional*, default to `[0.5, 0.5, 0.5]`):
            Normalisation constants.
        do_resize (`bool`, *optional*, defaults to `True`):
            Whether to resize (and crop). Without it, images are only padded to a multiple of the patch size.
        num_frames (`int`, *optional*, defaults to 8):
            Frames sampled uniformly from each video (the paper's 8), see [`MoeVieVideoProcessor`].
        do_sample_frames (`bool`, *optional*, defaults to `True`):
            Whether to sample `num_frames` frames from each video, or keep them all.
        Other arguments (`do_rescale`, `rescale_factor`, `do_normalize`, `do_convert_rgb`, `input_data_format`) work
        as in every transformers image processor.
    """

    # The frame options too: this processor also processes video frames, and its saved config holds their defaults.
    valid_kwargs = MoeVieVideosKwargs
    model_input_names = ["pixel_values", "pixel_attention_mask", "spatial_shapes"]

    resize_mode = "square"
    size = {"height": 224, "width": 224}
    patch_size = 16
    max_num_patches = 256
    resample = PILImageResampling.BICUBIC
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    num_frames = 8
    do_sample_frames = True

    def __init__(self, **kwargs: Unpack[MoeVieVideosKwargs]):
        super().__init__(**kwargs)
        check_resize_mode(self.resize_mode)

    def _prepare_images_structure(self, images: ImageInput, expected_ndims: int = 3) -> list:
        # transformers fails on a greyscale array without a channel axis, a number or a dict with messages that do not
        # say what to pass, and lets an empty list through to an obscure stacking error.
        check_images(images)
        return super()._prepare_images_structure(images, expected_ndims=expected_ndims)

    def process_image(self, image, input_data_format: str | ChannelDimension | None = None, **kwargs) -> np.ndarray:
        """Check the channel layout of array inputs, then convert to a channels-first RGB array like `PilBackend`."""
        if not is_pil_image(image):
            input_data_format = infer_channel_layout(tuple(image.shape), input_data_format)
        return super().process_image(image, input_data_format=input_data_format, **kwargs)

    def _validate_preprocess_kwargs(
        self, resize_mode: str, do_resize: bool | None = None, size: SizeDict | None = None, **kwargs
    ):
        check_resize_mode(resize_mode)
        if do_resize and resize_mode != "naflex" and (size is None or not (size.height and size.width)):
            raise ValueError(
                f"resize_mode={resize_mode!r} needs `size` as an int S or {{'height': S, 'width': S}}, got {size}."
            )
        super()._validate_preprocess_kwargs(do_resize=do_resize, size=size, **kwargs)

    def _resize_for_mode(
        self,
        image: np.ndarray,
        resize_mode: str,
        size: SizeDict,
        patch_size: int,
        max_num_patches: int,
        resample: PILImageResampling,
    ) -> np.ndarray:
        """Resize a (channels, height, width) uint8 image according to `resize_mode`."""
        if resize_mode == "square":
            return self.resize(image, size, resample=resample)
        if resize_mode == "center_crop":
            # Shorter side to S with the longer side truncated, as torchvision's `Resize(S)` does.
            image = self.resize(image, SizeDict(shortest_edge=max(size.height, size.width)), resample=resample)
            return self._center_crop_like_torchvision(image, size.height, size.width)
        height, width = get_image_size_for_max_num_patches(
            image.shape[-2], image.shape[-1], patch_size, max_num_patches
        )
        return self.resize(image, SizeDict(height=height, width=width), resample=resample)

    @staticmethod
    def _center_crop_like_torchvision(image: np.ndarray, height: int, width: int) -> np.ndarray:
        """
        Crop the centre (height, width) of an image at least that large.

        The offsets are torchvision's `CenterCrop` ones, `round((H - h) / 2)`, which the official transform uses;
        transformers' numpy crop floors them, which moves the crop by one pixel when H - h is 3 modulo 4.
        """
        top = round((image.shape[-2] - height) / 2)
        left = round((image.shape[-1] - width) / 2)
        return image[:, top : top + height, left : left + width]

    def _preprocess(
        self,
        images: list[np.ndarray],
        resize_mode: str,
        do_resize: bool,
        size: SizeDict,
        patch_size: int,
        max_num_patches: int,
        resample: PILImageResampling,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: tuple[float, ...],
        image_std: tuple[float, ...],
        return_tensors: str | None,
        **kwargs,
    ) -> BatchFeature:
        patches_per_image, spatial_shapes = [], []
        for image in images:
            if do_resize:
                image = self._resize_for_mode(image, resize_mode, size, patch_size, max_num_patches, resample)
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            image = pad_to_patch_multiple(image, patch_size)
            # (channels, height, width) -> (rows * cols, patch_size * patch_size * channels), (py, px, c) order
            patches_per_image.append(convert_image_to_patches(image, patch_size))
            spatial_shapes.append((image.shape[-2] // patch_size, image.shape[-1] // patch_size))

        # NaFlex pads to a fixed budget, like Siglip2, so batches keep one shape whatever the aspect ratios.
        num_slots = max_num_patches if resize_mode == "naflex" else max(len(patches) for patches in patches_per_image)
        pixel_values, pixel_attention_mask = [], []
        for patches in patches_per_image:
            if len(patches) > num_slots:
                raise ValueError(
                    f"An image has {len(patches)} patches, more than max_num_patches={num_slots}. Let the processor "
                    "resize it (do_resize=True) or raise max_num_patches."
                )
            patches, mask = pad_along_first_dim(patches, num_slots)
            pixel_values.append(patches)
            pixel_attention_mask.append(mask)

        data = {
            "pixel_values": np.stack(pixel_values).astype(np.float32),
            "pixel_attention_mask": np.stack(pixel_attention_mask),
            "spatial_shapes": np.array(spatial_shapes, dtype=np.int64),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)


class MoeVieVideoProcessor:
    r"""
    Samples frames from videos and runs every frame through a [`MoeVieImageProcessor`].

    transformers' video processors need torchvision and per-video `VideoMetadata`; this one needs neither. Frames
    must already be decoded. Outputs, with `T` the most frames sampled from any video of the batch (at most
    `num_frames`):

    - `pixel_values_videos (B, T, N_max, p * p * 3)` float32, zeros for padding frames;
    - `video_pixel_attention_mask (B, T, N_max)` int32, all zeros for padding frames;
    - `video_spatial_shapes (B, 2)` int64, one patch grid per video (its frames must share one size);
    - `padding_mask_videos (B, T)` bool, False for padding frames.

    Args:
        image_processor ([`MoeVieImageProcessor`]):
            Processes every sampled frame; its settings (and per-call overrides) apply to videos too, including
            `num_frames` (frames sampled uniformly from each video; shorter videos keep all their frames) and
            `do_sample_frames` (`False` keeps every frame).
    """

    valid_kwargs = MoeVieVideosKwargs
    model_input_names = [
        "pixel_values_videos",
        "video_pixel_attention_mask",
        "video_spatial_shapes",
        "padding_mask_videos",
    ]

    def __init__(self, image_processor: MoeVieImageProcessor):
        self.image_processor = image_processor

    def __call__(
        self,
        videos,
        num_frames: int | None = None,
        do_sample_frames: bool | None = None,
        return_tensors: str | None = None,
        **kwargs,
    ) -> BatchFeature:
        """
        Process one video or a list of videos (see [`make_list_of_videos`]); `kwargs` go to the image processor.
        """
        num_frames = self.image_processor.num_frames if num_frames is None else num_frames
        if do_sample_frames is None:
            do_sample_frames = self.image_processor.do_sample_frames
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}.")
        videos = make_list_of_videos(videos)
        if do_sample_frames:
            videos = [[video[i] for i in sample_frame_indices(len(video), num_frames)] for video in videos]
        # One call for all frames of the batch, so that every frame gets the same number of patch slots.
        frames = self.image_processor([frame for video in videos for frame in video], return_tensors=None, **kwargs)

        num_slots = max(len(video) for video in videos)
        num_patches, patch_dim = frames["pixel_values"].shape[1:]
        pixel_values = np.zeros((len(videos), num_slots, num_patches, patch_dim), dtype=np.float32)
        pixel_attention_mask = np.zeros((len(videos), num_slots, num_patches), dtype=np.int32)
        padding_mask = np.zeros((len(videos), num_slots), dtype=bool)
        spatial_shapes = np.zeros((len(videos), 2), dtype=np.int64)
        start = 0
        for index, video in enumerate(videos):
            stop = start + len(video)
            shapes = frames["spatial_shapes"][start:stop]
            if (shapes != shapes[0]).any():
                raise ValueError(
                    f"The frames of video {index} give different patch grids {np.unique(shapes, axis=0).tolist()}: "
                    "all frames of a video must have the same size."
                )
            pixel_values[index, : len(video)] = frames["pixel_values"][start:stop]
            pixel_attention_mask[index, : len(video)] = frames["pixel_attention_mask"][start:stop]
            padding_mask[index, : len(video)] = True
            spatial_shapes[index] = shapes[0]
            start = stop

        data = {
            "pixel_values_videos": pixel_values,
            "video_pixel_attention_mask": pixel_attention_mask,
            "video_spatial_shapes": spatial_shapes,
            "padding_mask_videos": padding_mask,
        }
        return BatchFeature(data=data, tensor_type=return_tensors)


class MoeVieProcessorKwargs(ProcessingKwargs, total=False):
    images_kwargs: MoeVieImageProcessorKwargs
    videos_kwargs: MoeVieVideosKwargs


class MoeVieProcessor(ChecksInputs):
    r"""
    Processor for MoE-ViE: a [`MoeVieImageProcessor`] for images and video frames and a CLIP tokenizer for text.

    `processor(text=..., images=..., videos=..., return_tensors="pt")` returns one `BatchFeature` with the keys of
    whichever inputs were given: `input_ids` and `attention_mask`; `pixel_values`, `pixel_attention_mask` and
    `spatial_shapes`; and the video keys of [`MoeVieVideoProcessor`]. Keyword arguments are routed to the part that
    accepts them (`padding="longest"` to the tokenizer, `size=112` to images and videos, `num_frames=4` to videos);
    one that no part takes is an error.

    `text` is a string or a list of strings; `images` one image or a list of images; `videos` one video or a list of
    videos, a video being a list of frames or a `(num_frames, height, width, channels)` array. A flat list of frames
    is one video, so `videos=[frame]` is a one-frame video and `videos=[[frame]]` a batch of one; a frame alone
    (`videos=frame`) is refused, since a still image belongs in `images=`. The model compares texts with images or
    with videos, so it needs `text` and one of `images` and `videos`; the processor also serves one modality at a
    time, for `get_text_features`, `get_image_features` and `get_video_features`.

    Text is padded to the tokenizer's `model_max_length` and truncated by default, like the official tokenizer
    (which keeps the end-of-text token last); pass `padding="longest"` for shorter batches. Both give the same text
    embeddings, since the text tower is causal and pools at the first end-of-text token.

    Args:
        image_processor ([`MoeVieImageProcessor`]):
            The image processor, also used for video frames.
        tokenizer ([`CLIPTokenizer`]):
            A CLIP BPE tokenizer (the official model uses OpenAI's vocabulary, `model_max_length=144`).
    """

    valid_processor_kwargs = MoeVieProcessorKwargs
    text_kwargs = {"padding": "max_length", "truncation": True}

    # ProcessorMixin finds its sub-processors by the names of the `__init__` arguments.
    def __init__(self, image_processor, tokenizer):
        super().__init__(image_processor, tokenizer)

    @classmethod
    def from_args_and_dict(cls, args, processor_dict: dict, **kwargs):
        # Folders saved before the frame settings moved to the image processor hold `num_frames` in the processor's
        # own config, which `ProcessorMixin` would drop: it goes to the image processor, which owns it now.
        if "num_frames" in processor_dict:
            args[cls.get_attributes().index("image_processor")].num_frames = processor_dict.pop("num_frames")
        return super().from_args_and_dict(args, processor_dict, **kwargs)

    @property
    def video_processor(self) -> MoeVieVideoProcessor:
        # Built on access, not stored: the image processor owns every frame setting, and ProcessorMixin does not try
        # to save or load it as a sub-processor (transformers' video processors need torchvision).
        return MoeVieVideoProcessor(self.image_processor)

    @property
    def model_input_names(self) -> list[str]:
        return super().model_input_names + MoeVieVideoProcessor.model_input_names


__all__ = ["MoeVieImageProcessor", "MoeVieProcessor", "MoeVieVideoProcessor"]
