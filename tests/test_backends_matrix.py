"""Every zoo model class switches its experts and attention implementations as transformers' own MoE models do (issue
21 item 2): `from_pretrained(..., experts_implementation=x)` and `set_experts_implementation(x)` for every x of
transformers' and moezoo's, `set_attn_implementation` for eager, sdpa and, where the transformers base model supports
it, flex attention; each gives the outputs of `eager` (1e-5, fp32); flash_attention_2 without flash-attn is refused
while the model is built. The exported Hub folder of one architecture per family does the same in a fresh process
without moezoo. docs/kernels.md#backends lists what this proves.
"""

import inspect

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers.utils import is_flash_attn_2_available
from transformers.utils.generic import ModelOutput

import moezoo  # noqa: F401  (fills the catalogue)
from moezoo.hub.export import export_folder
from moezoo.registry import ARCHITECTURES, PRESETS, ZOO_ARCHITECTURES, resolve
from moezoo.zoo import create_from_preset

from conftest import run_python


EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", "moezoo", "moezoo_triton")
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
# The transformers base models that declare no flex attention (`_supports_flex_attn`); the zoo keeps their choice.
WITHOUT_FLEX_ATTENTION = {"moemb": "Qwen3.5-MoE", "smoes_qwen3_5_moe": "Qwen3.5-MoE", "glm_ocr_mote": "GLM-OCR"}
# Accepted but failing in the forward: known bugs, each an expected failure until it is fixed.
FAILING_ATTENTION: dict[str, dict[str, str]] = {}
# One architecture per family goes through the exported folder in a fresh process.
EXPORTED = ("moe_vie", "moemb", "llama_mote", "omnimoe_vl")
TOLERANCE = 1e-5


def sample_image() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))


def sample_inputs(architecture: str, processor, config) -> dict[str, torch.Tensor]:
    """A batch of one or two examples through the architecture's own processor (or tokenizer)."""
    image = sample_image()
    if architecture == "moe_vie":
        inputs = processor(text=["a red square", "a blue circle"], images=[image], return_tensors="pt")
    elif architecture == "moemb":
        inputs = processor([{"instruction": "Find the caption of this image.", "images": [image]}], return_tensors="pt")
    elif architecture == "llama_mote":
        inputs = dict(processor(["what is the next step ?"], return_tensors="pt"), task_ids=torch.tensor([1]))
    elif architecture == "glm_ocr_mote":
        inputs = processor(images=[image], text=[processor.render_prompt("Text Recognition:")],
                           task=config.text_config.mote_expert_names[-1], return_tensors="pt")
    elif architecture == "videollm_mote":
        inputs = processor(videos=[[image, image]], text=[processor.render_prompt("What is the current step?")],
                           task=config.text_config.mote_expert_names[1], return_tensors="pt")
    elif architecture == "omnimoe_vl":
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
        inputs = processor(images=[image], text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                           return_tensors="pt")
    elif architecture in ("smoes_qwen3_5_moe", "smoes_qwen3_vl_moe"):  # text alone reaches every routed layer
        inputs = processor(text=["what color is the car ?"], return_tensors="pt")
    else:
        raise KeyError(f"no sample inputs for {architecture!r}: add them to sample_inputs")
    return {name: value for name, value in inputs.items() if torch.is_tensor(value)}


def output_tensors(outputs: ModelOutput) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a model output by name (nested tuples flattened: `hidden_states.0`, ...)."""
    found = {}

    def visit(name, value):
        if torch.is_tensor(value) and value.is_floating_point():
            found[name] = value
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                visit(f"{name}.{index}", item)
        elif isinstance(value, ModelOutput):
            for key, item in value.items():
                visit(f"{name}.{key}", item)

    for key, value in outputs.items():
        visit(key, value)
    return found


def assert_same_outputs(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=TOLERANCE, msg=f"{what}: {name}")


@pytest.fixture(scope="module", params=ZOO_ARCHITECTURES)
def created(request, tmp_path_factory):
    """(architecture, created folder, sample inputs) for the tiny preset of each zoo architecture."""
    architecture = request.param
    preset = next(p.name for p in PRESETS.values() if p.architecture == architecture and p.name.startswith("tiny-"))
    folder = create_from_preset(preset, tmp_path_factory.mktemp(architecture) / "created")
    entry = ARCHITECTURES[architecture]
    processor = resolve(entry.processor or entry.tokenizer).from_pretrained(folder)
    return architecture, folder, sample_inputs(architecture, processor, entry.config_class().from_pretrained(folder))


def model_classes(architecture: str) -> list[type]:
    return [resolve(path) for path in dict.fromkeys(ARCHITECTURES[architecture].models.values())]


def run(model, inputs) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return output_tensors(model(**inputs))


# moezoo_triton runs in Triton's interpreter on the CPU (tests/conftest.py): seconds a forward.
@pytest.mark.parametrize(
    "implementation", [*EXPERTS_IMPLEMENTATIONS[:-1], pytest.param("moezoo_triton", marks=pytest.mark.slow)]
)
def test_every_class_loads_with_and_switches_to_every_experts_implementation(created, implementation):
    architecture, folder, inputs = created
    for model_class in model_classes(architecture):
        what = f"{model_class.__name__} experts_implementation={implementation!r}"
        model = model_class.from_pretrained(folder, experts_implementation="eager").eval()
        reference = run(model, inputs)
        loaded = model_class.from_pretrained(folder, experts_implementation=implementation).eval()
        assert loaded.config._experts_implementation == implementation, what
        assert_same_outputs(run(loaded, inputs), reference, what)
        model.set_experts_implementation(implementation)
        if model._can_set_experts_implementation():  # a model without fused experts keeps its config: nothing switches
            assert model.config._experts_implementation == implementation, what
        assert_same_outputs(run(model, inputs), reference, f"{what} (set_experts_implementation)")


# Flex attention compiles a kernel for every shape it meets: tens of seconds on the CPU.
@pytest.mark.parametrize("implementation", ["sdpa", pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_every_class_switches_the_attention_implementations_its_base_supports(created, implementation, request):
    architecture, folder, inputs = created
    if implementation in FAILING_ATTENTION.get(architecture, {}):
        request.applymarker(pytest.mark.xfail(strict=True, reason=FAILING_ATTENTION[architecture][implementation]))
    for model_class in model_classes(architecture):
        model = model_class.from_pretrained(folder, attn_implementation="eager").eval()
        reference = run(model, inputs)
        what = f"{model_class.__name__} attn_implementation={implementation!r}"
        if implementation == "flex_attention" and architecture in WITHOUT_FLEX_ATTENTION:
            with pytest.raises(ValueError, match="does not support an attention implementation through torch's "
                                                 "flex_attention"):
                model.set_attn_implementation(implementation)
            continue
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation, what
        assert_same_outputs(run(model, inputs), reference, what)


@pytest.mark.skipif(is_flash_attn_2_available(), reason="flash-attn is installed here")
def test_an_attention_backend_that_is_not_installed_is_refused_when_the_model_is_built(created):
    """flash_attention_2 without flash-attn (a CUDA-only package): transformers refuses it, naming it, while it builds
    the model, before any weight is read."""
    architecture, folder, _ = created
    for model_class in model_classes(architecture):
        with pytest.raises((ImportError, ValueError), match="FlashAttention2|Flash Attention 2"):
            model_class.from_pretrained(folder, attn_implementation="flash_attention_2")


@pytest.mark.slow
@pytest.mark.parametrize("created", EXPORTED, indirect=True)
def test_exported_folders_switch_the_same_implementations_without_moezoo(created, tmp_path):
    architecture, folder, inputs = created
    exported = export_folder(folder, tmp_path / "exported")
    auto_class = next(iter(ARCHITECTURES[architecture].models))
    reference = run(ARCHITECTURES[architecture].model_class().from_pretrained(folder).eval(), inputs)
    # Views (the last hidden state is one of the hidden states) are saved as tensors of their own.
    reference = {name: value.clone(memory_format=torch.contiguous_format) for name, value in reference.items()}
    save_file(reference, tmp_path / "reference.safetensors")
    save_file(inputs, tmp_path / "inputs.safetensors")
    attention = [x for x in ATTENTION_IMPLEMENTATIONS if x != "flex_attention" or architecture not in
                 {*WITHOUT_FLEX_ATTENTION, *FAILING_ATTENTION}]
    helpers = "".join(inspect.getsource(function) for function in (output_tensors, assert_same_outputs))
    run_python(f"""
import torch, transformers
from safetensors.torch import load_file
from transformers.utils.generic import ModelOutput
TOLERANCE = {TOLERANCE!r}
{helpers}
inputs = load_file({str(tmp_path / "inputs.safetensors")!r})
reference = load_file({str(tmp_path / "reference.safetensors")!r})
auto_class = getattr(transformers, {auto_class!r})


def check(model, what):
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    with torch.no_grad():
        assert_same_outputs(output_tensors(model(**inputs)), reference, what)


switched = auto_class.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()
for implementation in {EXPERTS_IMPLEMENTATIONS!r}:
    loaded = auto_class.from_pretrained({str(exported)!r}, trust_remote_code=True,
                                        experts_implementation=implementation).eval()
    assert loaded.config._experts_implementation == implementation, implementation
    check(loaded, "experts_implementation=" + implementation)
    switched.set_experts_implementation(implementation)
    if switched._can_set_experts_implementation():
        assert switched.config._experts_implementation == implementation, implementation
    check(switched, "set_experts_implementation " + implementation)
for implementation in {attention!r}:
    switched.set_attn_implementation(implementation)
    check(switched, "set_attn_implementation " + implementation)
""", without_moezoo=True)
