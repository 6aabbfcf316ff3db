"""`url_to_local_path`: the local stand-in of a test fixture that transformers' CI downloads before its tests run.

In transformers' repository, `utils/fetch_hub_objects_for_ci.py` maps each fixture URL to a file fetched ahead of time.
Here nothing can be downloaded, so an image fixture is drawn instead (a fixed-seed picture of the same kind, made once
per process); videos and audio have no stand-in (no decoder is installed to read one), and the tests that read them
need a decoder package that transformers' `require_av` / `require_torchcodec` / `require_librosa` check for.
"""

import tempfile
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from PIL import Image


_FIXTURES = Path(tempfile.mkdtemp(prefix="moezoo-transformers-fixtures-"))
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


def url_to_local_path(url: str) -> str:
    path = _FIXTURES / Path(urlparse(url).path).name
    if path.suffix.lower() in IMAGE_SUFFIXES and not path.exists():
        pixels = np.random.default_rng(0).integers(0, 256, size=(480, 640, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
    return str(path)
