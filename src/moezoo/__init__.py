"""moezoo: a Hugging Face Hub-compatible zoo of multimodal Mixture-of-Experts models."""

__version__ = "0.1.0"
