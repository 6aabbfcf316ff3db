"""An exported MoEMB folder under sentence-transformers: `SentenceTransformer(folder, trust_remote_code=True).encode`
in a fresh process without moezoo gives the model's own embeddings for texts (with the prompt as instruction),
images, image + text and videos."""

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_python
from moezoo.hub.export import export_folder
from moezoo.modeling.moemb import MoEmbForEmbedding
from moezoo.processors.moemb import MoEmbProcessor
from moezoo.zoo import create_from_preset

pytest.importorskip("sentence_transformers", minversion="6.0")


def export_tiny_moemb(folder):
    """`moezoo create tiny-moemb` then `moezoo export` (which writes the sentence-transformers files)."""
    created = create_from_preset("tiny-moemb", folder.with_name("created"), seed=0)
    export_folder(created, folder)
    return MoEmbForEmbedding.from_pretrained(created).eval(), MoEmbProcessor.from_pretrained(created)


def test_sentence_transformers_encode_equals_the_model(tmp_path):
    folder = tmp_path / "exported"
    model, processor = export_tiny_moemb(folder)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "image.png")
    frames = rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    np.save(tmp_path / "frames.npy", frames)

    run_python(f"""
        import numpy as np
        from PIL import Image
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer({str(folder)!r}, trust_remote_code=True, device="cpu")
        assert model.get_embedding_dimension() == 64
        image = Image.open({str(tmp_path / "image.png")!r})
        frames = list(np.load({str(tmp_path / "frames.npy")!r}))
        np.savez(
            {str(tmp_path / "encoded.npz")!r},
            texts=model.encode(["a red circle", "a long caption of a blue square"], prompt="Find the image."),
            images=model.encode([image, {str(tmp_path / "image.png")!r}]),
            mixed=model.encode([{{"text": "what is it?", "image": image}}]),
            video=model.encode([{{"video": frames}}]),
        )
    """, without_moezoo=True, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    encoded = np.load(tmp_path / "encoded.npz")

    pil = Image.open(tmp_path / "image.png")
    expected = {
        "texts": [{"instruction": "Find the image.", "text": "a red circle"},
                  {"instruction": "Find the image.", "text": "a long caption of a blue square"}],
        "images": [{"images": [pil]}, {"images": [pil]}],
        "mixed": [{"text": "what is it?", "images": [pil]}],
        "video": [{"video": list(frames)}],
    }  # fmt: skip
    with torch.no_grad():
        for name, items in expected.items():
            embeddings = model(**processor(items)).embeddings.numpy()
            np.testing.assert_allclose(encoded[name], embeddings, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(np.linalg.norm(encoded["texts"], axis=-1), 1.0, atol=1e-6)
    assert not np.allclose(encoded["texts"][0], encoded["texts"][1])
