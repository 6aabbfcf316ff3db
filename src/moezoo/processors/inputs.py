"""The inputs shared by the zoo's processors: what counts as an image, a frame, a video and a batch of them, checked
before any processing so that a mistake gets an error saying what to pass instead (transformers' own checks fail later
with "'int' object is not iterable" or "Unable to infer channel dimension format").

Exported with the processors that import it, so it imports nothing but numpy and transformers.
"""

from pathlib import Path

import numpy as np
from transformers.image_utils import is_pil_image, is_valid_image
from transformers.processing_utils import ProcessorMixin


# Greyscale, RGB and RGBA: the channel counts `convert_to_rgb` turns into RGB.
SUPPORTED_NUM_CHANNELS = (1, 3, 4)
IMAGE_FORMS = "a PIL image or a (height, width, channels) or (channels, height, width) array"
VIDEO_FORMS = "a list of frames or a (num_frames, height, width, channels) array"


def is_array(obj) -> bool:
    """Whether `obj` is a numpy array or a torch tensor."""
    return is_valid_image(obj) and not is_pil_image(obj)


def is_frame(obj) -> bool:
    """Whether `obj` is one image: a PIL image or a 3D numpy array or torch tensor."""
    return is_pil_image(obj) or (is_array(obj) and obj.ndim == 3)


def describe(value) -> str:
    """What an error calls a value the user passed: its type, and the shape and dtype of an array ("an int",
    "a ndarray of shape (8, 8) and dtype uint8")."""
    name = type(value).__name__
    article = "an" if name[0].lower() in "aeiou" else "a"
    if is_array(value):
        return f"{article} {name} of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{article} {name}"


def _has_pixel_dtype(array) -> bool:
    """Whether an array holds numbers an image can be made of: not booleans (a mask), complex numbers or objects."""
    if isinstance(array.dtype, np.dtype):
        return array.dtype.kind in "uif"
    return not (array.dtype.is_complex or str(array.dtype) == "torch.bool")  # a torch dtype


def missing_channel_axis_error(shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"Expected an image of shape (height, width, channels) or (channels, height, width), got shape "
        f"{tuple(shape)}. Add a channel axis to greyscale arrays (e.g. `image[..., None]`)."
    )


def check_image(image, name: str, paths: bool = False) -> None:
    """
    Raise a `ValueError` that names the input (`name`, e.g. "input 0: image 1") and says what to pass, unless `image`
    is one image: a PIL image, or a 3D numpy array or torch tensor of numbers with 1, 3 or 4 channels first or last
    (or, with `paths`, a file path or URL, which the processor opens itself).
    """
    if is_pil_image(image) or (paths and isinstance(image, (str, Path))):
        return
    forms = IMAGE_FORMS + ", or a path" if paths else IMAGE_FORMS
    if not is_array(image) or image.ndim != 3:
        hint = ""
        if is_array(image) and image.ndim == 2:
            hint = " Add a channel axis to greyscale arrays (e.g. `image[..., None]`)."
        elif isinstance(image, (list, tuple)) or is_array(image) and image.ndim == 4:
            hint = " List several images one by one."
        raise ValueError(f"{name} is {describe(image)}; each image must be {forms}.{hint}")
    if not _has_pixel_dtype(image):
        raise ValueError(
            f"{name} is {describe(image)}; images hold numbers: uint8 in [0, 255], or floats (in [0, 1] with "
            "do_rescale=False). Convert a boolean mask with `mask.astype(np.uint8) * 255`."
        )
    if image.shape[0] not in SUPPORTED_NUM_CHANNELS and image.shape[-1] not in SUPPORTED_NUM_CHANNELS:
        raise ValueError(
            f"{name} is {describe(image)}, with no channel axis of size {SUPPORTED_NUM_CHANNELS} (greyscale, RGB, "
            "RGBA) first or last. Convert it to one of these, channels first or last."
        )


def check_images(images, name: str = "`images`") -> None:
    """
    Check `images` as transformers' image processors take them: one image, a 4D array of images, or a list (or a list
    of lists, one per text) of images and 4D arrays; file paths and URLs are opened by the processor. In a list of
    lists, an empty list is a text without images, as in transformers (a batch mixing texts with and without images),
    as long as the batch holds an image; an empty list beside images is refused.
    """
    if isinstance(images, (list, tuple)) or (is_array(images) and images.ndim == 4):
        if len(images) == 0:
            raise ValueError(f"{name} is empty: pass at least one image.")
        if isinstance(images, (list, tuple)):
            per_text = name == "`images`" and all(isinstance(entry, (list, tuple)) for entry in images)
            if per_text and not any(images):
                raise ValueError("`images` holds only empty lists: pass at least one image.")
            for index, entry in enumerate(images):
                if not (per_text and len(entry) == 0):
                    check_images(entry, f"image {index}" if name == "`images`" else f"{name}, {index}")
            return
        images = images[0]  # a 4D array: its images share one shape and dtype
    check_image(images, name, paths=True)


def is_list_of_videos(obj) -> bool:
    """Whether `obj` is a non-empty list of videos (4D arrays or lists), rather than a video (a list of frames)."""
    return (
        isinstance(obj, (list, tuple))
        and len(obj) > 0
        and all(isinstance(video, (list, tuple)) or (is_array(video) and video.ndim == 4) for video in obj)
    )


def make_list_of_videos(videos) -> list[list]:
    """
    Turn `videos` into a list of videos, each a non-empty list of frames (PIL images or 3D arrays).

    A video is a list of frames or a 4D `(num_frames, height, width, channels)` array (numpy or torch); `videos` is one
    video or a list of them (or a 5D array). A flat list of frames is a single video, as in transformers'
    `make_batched_videos`, so a one-frame video is `[frame]` (or `[[frame]]` in a batch); a frame alone is refused, as
    it is more likely a still image meant for `images=`. A list of lists of videos, one list per text, is flattened as
    `make_batched_videos` does; there an empty list is a text without videos. Unlike `make_batched_videos`, which
    silently drops empty videos, empty videos raise, and nothing here needs a video decoder or `VideoMetadata`.
    """
    if is_array(videos) and videos.ndim == 5:
        videos = list(videos)
    elif (is_array(videos) and videos.ndim == 4) or (
        isinstance(videos, (list, tuple)) and len(videos) > 0 and all(is_frame(frame) for frame in videos)
    ):
        videos = [videos]
    elif isinstance(videos, (list, tuple)) and any(map(is_list_of_videos, videos)):
        if not all(isinstance(group, (list, tuple)) for group in videos):
            raise ValueError(
                "`videos` mixes videos with lists of videos: pass a list of videos, or one list of videos per text."
            )
        videos = [video for group in videos for video in group]
    if not isinstance(videos, (list, tuple)):
        raise ValueError(
            f"`videos` is {describe(videos)}; expected a video ({VIDEO_FORMS}) or a list of videos."
            + (" A frame alone is not a video: pass a one-frame video as [frame]." if is_frame(videos) else "")
            + (" Decode video files into frames first." if isinstance(videos, (str, Path)) else "")
        )
    if len(videos) == 0:
        raise ValueError("`videos` is an empty list: pass at least one video.")
    batch = []
    for index, video in enumerate(videos):
        if not (isinstance(video, (list, tuple)) or (is_array(video) and video.ndim == 4)):
            decode = " Decode video files into frames first." if isinstance(video, (str, Path)) else ""
            raise ValueError(f"Video {index} is {describe(video)}; expected {VIDEO_FORMS}.{decode}")
        if len(video) == 0:
            raise ValueError(f"Video {index} has no frames: every video needs at least one frame.")
        for number, frame in enumerate(video):
            check_image(frame, f"Video {index}, frame {number}")
        batch.append(list(video))
    return batch


def check_texts(text) -> None:
    """Raise a `ValueError` saying what to pass unless `text` is a string or a non-empty list of strings."""
    if isinstance(text, str):
        return
    if not isinstance(text, (list, tuple)):
        raise ValueError(f"`text` is {describe(text)}; pass a string or a list of strings.")
    if len(text) == 0:
        raise ValueError("`text` is an empty list: pass at least one string.")
    for index, entry in enumerate(text):
        if not isinstance(entry, str):
            raise ValueError(f"text {index} is {describe(entry)}; pass a string or a list of strings.")


class ChecksInputs(ProcessorMixin):
    """
    A `ProcessorMixin` that checks `text` and `images` before transformers prepares
    them (its own checks fail with "'int' object is not iterable", or let an empty list through), and refuses an
    option that no part of the processor takes, which `ProcessorMixin` only warns about and ignores: a typo
    (`sise=112`) would silently process at the default size.
    """

    def prepare_inputs_layout(self, images=None, text=None, videos=None, audio=None, **kwargs):
        if text is not None:
            check_texts(text)
        if images is not None:
            check_images(images)
        return super().prepare_inputs_layout(images=images, text=text, videos=videos, audio=audio, **kwargs)

    def _merge_kwargs(self, ModelProcessorKwargs=None, tokenizer_init_kwargs=None, **kwargs) -> dict:
        processor_kwargs = ModelProcessorKwargs or self.valid_processor_kwargs
        inputs = {"text", "images", "videos", "audio"}
        # `common_kwargs` (options for every modality) is not annotated on `ProcessingKwargs`, but `_merge_kwargs` takes it.
        known = set(processor_kwargs.__annotations__) | inputs | {"common_kwargs"}
        parts = {"text_kwargs": "tokenizer", "images_kwargs": "image_processor",
                 "videos_kwargs": "video_processor", "audio_kwargs": "feature_extractor"}  # fmt: skip
        for modality, part in parts.items():
            known |= set(processor_kwargs.__annotations__[modality].__annotations__)
            known |= set(getattr(getattr(getattr(self, part, None), "valid_kwargs", None), "__annotations__", {}))
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"Unknown option(s) {', '.join(unknown)} for {type(self).__name__}; it takes "
                f"{', '.join(sorted(known - inputs))}."
            )
        return super()._merge_kwargs(ModelProcessorKwargs, tokenizer_init_kwargs, **kwargs)
