"""Image files opened as they display, for the processors (MoEMB's image paths) and the training and evaluation data
loaders alike, so that an image trains, evaluates and serves the same.

Exported with the processors that import it, so it imports nothing but PIL, numpy and the standard library.
"""

import io

import numpy as np
from PIL import Image, ImageOps


def open_image(image) -> Image.Image:
    """An RGB image as it displays, from a path, a datasets image record (`{"bytes", "path"}`) or a PIL image:

    - the EXIF orientation applied, as datasets' image feature and transformers' `load_image` do (a photo taken
      upright but stored sideways would otherwise train sideways, and differently from an image folder of it);
    - transparent pixels on white, as transformers' processors composite them (`convert("RGB")` keeps the colour
      they hide, usually black);
    - 16-bit greyscale scaled to 8 bits (PIL's conversion clips it, nearly all white).

    A file that does not exist or cannot be read (corrupt, truncated) is an error naming it.
    """
    if isinstance(image, Image.Image):
        return _displayed_rgb(image)
    if isinstance(image, dict):
        name = image.get("path") or "an embedded image"
        file = io.BytesIO(image["bytes"]) if image.get("bytes") is not None else image.get("path")
    else:
        name = file = str(image)
    try:
        with Image.open(file) as opened:
            return _displayed_rgb(opened)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"no image file {name}") from error
    except (OSError, SyntaxError, ValueError) as error:  # PIL's errors for unreadable files never name the file
        raise ValueError(f"cannot read the image {name}: {error}") from error


def _displayed_rgb(image: Image.Image) -> Image.Image:
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I;16"):
        image = Image.fromarray((np.asarray(image, dtype=np.float32) / 257).round().astype(np.uint8))
    if image.has_transparency_data:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB")
