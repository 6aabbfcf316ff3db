"""sentence-transformers module of an exported MoEMB folder: `SentenceTransformer(folder, trust_remote_code=True)`.

The folder's `modules.json` names this file's `MoEmbSentenceEncoder` as the only module (see
`moezoo.hub.sentence_transformers_files`). It loads the folder's model and processor with the Auto classes, so
`encode` returns exactly the model's own L2-normalised embeddings:

    model = SentenceTransformer(folder, trust_remote_code=True)
    model.encode(["a red square"], prompt="Find the image of the caption.")   # the prompt is MoEMB's instruction
    model.encode([image])                                                     # PIL images, arrays, image paths
    model.encode([{"text": "What is it?", "image": image}])                   # image + text in one input
    model.encode([{"video": frames}])                                         # a list of frames

This file is copied into exported folders and only imported by sentence-transformers (>= 6), which it requires.
"""

from sentence_transformers.base.modality import infer_modality
from sentence_transformers.base.modules.input_module import InputModule
from transformers import AutoModel, AutoProcessor


class MoEmbSentenceEncoder(InputModule):
    """MoEMB as a single sentence-transformers module: preprocessing by `MoEmbProcessor`, embeddings by
    `MoEmbForEmbedding` (pooled at `<emb>` and normalised), returned as `sentence_embedding`."""

    config_file_name = "sentence_moemb_config.json"
    config_keys = ["max_length"]
    save_in_root = True

    def __init__(self, model_name_or_path: str, max_length: int | None = None, model_kwargs: dict | None = None,
                 processor_kwargs: dict | None = None):  # fmt: skip
        super().__init__()
        self.max_length = max_length
        self.model = AutoModel.from_pretrained(model_name_or_path, **(model_kwargs or {}))
        self.processor = AutoProcessor.from_pretrained(model_name_or_path, **(processor_kwargs or {}))

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token=None, cache_folder=None, revision=None,
             local_files_only: bool = False, trust_remote_code: bool = False, model_kwargs: dict | None = None,
             processor_kwargs: dict | None = None, **kwargs):  # fmt: skip
        config = cls.load_config(model_name_or_path, subfolder=subfolder, token=token, cache_folder=cache_folder,
                                 revision=revision, local_files_only=local_files_only)  # fmt: skip
        hub = {"token": token, "cache_dir": cache_folder, "revision": revision, "local_files_only": local_files_only,
               "trust_remote_code": trust_remote_code}  # fmt: skip
        return cls(model_name_or_path, **config, model_kwargs=hub | (model_kwargs or {}),
                   processor_kwargs=hub | (processor_kwargs or {}))  # fmt: skip

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def modalities(self) -> list:
        # Combined inputs are listed as sorted tuples, as sentence-transformers names a dict input's modality.
        return ["text", "image", "video", ("image", "text"), ("text", "video")]

    def get_embedding_dimension(self) -> int:
        return self.model.config.text_config.hidden_size

    def preprocess(self, inputs, prompt: str | None = None, **kwargs) -> dict:
        """sentence-transformers inputs -> the processor's batch; `prompt` becomes every input's instruction."""
        items = [self._moemb_input(sample, prompt) for sample in inputs]
        return dict(self.processor(items, max_length=self.max_length))

    def _moemb_input(self, sample, prompt: str | None) -> dict:
        modality = infer_modality(sample, supported_modalities=self.modalities)
        if modality == "text":
            item = {"text": sample}
        elif modality == "image":
            item = {"images": [sample["image"] if isinstance(sample, dict) else sample]}
        elif modality == "video":
            video = sample["video"] if isinstance(sample, dict) and "video" in sample else sample
            item = {"video": video["array"] if isinstance(video, dict) else video}  # a VideoDict's frames
        elif isinstance(modality, tuple):
            item = {"text": sample["text"], "images": sample.get("image"), "video": sample.get("video")}
        else:
            raise ValueError(f"MoEMB embeds texts, images, videos and their combinations, not {modality!r} inputs")
        return item | ({"instruction": prompt} if prompt else {})

    def forward(self, features: dict, **kwargs) -> dict:
        inputs = {name: value for name, value in features.items() if name in self.processor.model_input_names}
        features["sentence_embedding"] = self.model(**inputs).embeddings
        return features

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.model.save_pretrained(output_path, safe_serialization=safe_serialization)
        self.processor.save_pretrained(output_path)
        self.save_config(output_path)
