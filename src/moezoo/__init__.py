"""moezoo: a Hugging Face Hub-compatible zoo of multimodal Mixture-of-Experts models.

Importing moezoo registers every architecture with transformers' Auto classes, so the folders it writes load
without remote code wherever moezoo is installed.
"""

__version__ = "0.1.0"


def _register_architectures() -> None:
    from .registry import ARCHITECTURES, load_catalogue, register_auto_classes

    load_catalogue()
    for architecture in ARCHITECTURES.values():
        register_auto_classes(architecture)


_register_architectures()
