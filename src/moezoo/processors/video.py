"""Video inputs shared by the zoo's processors: what counts as a frame, a video and a batch of videos.

Exported with the processors that import it, so it imports nothing but transformers.
"""

from transformers.image_utils import is_pil_image, is_valid_image


def is_array(obj) -> bool:
    """Whether `obj` is a numpy array or a torch tensor."""
    return is_valid_image(obj) and not is_pil_image(obj)


def is_frame(obj) -> bool:
    """Whether `obj` is one image: a PIL image or a 3D numpy array or torch tensor."""
    return is_pil_image(obj) or (is_array(obj) and obj.ndim == 3)


def make_list_of_videos(videos) -> list[list]:
    """
    Turn `videos` into a list of videos, each a non-empty list of frames (PIL images or 3D arrays).

    A video is a list of frames or a 4D `(num_frames, height, width, channels)` array (numpy or torch); `videos` is one
    video or a list of them (or a 5D array). Unlike `transformers.video_utils.make_batched_videos`, which silently
    drops empty videos, empty inputs raise, and nothing here needs a video decoder or `VideoMetadata`.
    """
    if is_array(videos) and videos.ndim == 5:
        videos = list(videos)
    elif (is_array(videos) and videos.ndim == 4) or (
        # A flat list of frames is a single video, as in `make_batched_videos`.
        isinstance(videos, (list, tuple)) and len(videos) > 0 and all(is_frame(frame) for frame in videos)
    ):
        videos = [videos]
    if not isinstance(videos, (list, tuple)):
        raise ValueError(
            f"Expected a video (a list of frames or a (num_frames, height, width, channels) array) or a list of "
            f"videos, got a {type(videos).__name__} of shape {getattr(videos, 'shape', None)}. Decode video files "
            "into frames first, and pass a single frame as a one-frame video: [[frame]]."
        )
    if len(videos) == 0:
        raise ValueError("`videos` is an empty list: pass at least one video.")
    batch = []
    for index, video in enumerate(videos):
        if not (isinstance(video, (list, tuple)) or (is_array(video) and video.ndim == 4)):
            raise ValueError(
                f"Video {index} is a {type(video).__name__} of shape {getattr(video, 'shape', None)}; expected a list "
                "of frames or a (num_frames, height, width, channels) array."
            )
        if len(video) == 0:
            raise ValueError(f"Video {index} has no frames: every video needs at least one frame.")
        batch.append(list(video))
    return batch
