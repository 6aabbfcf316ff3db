"""MoTE in the catalogue: VideoLLM-MoTE (main), GLM-OCR-MoTE and the text-only LlamaMote, their presets and
converters."""

import transformers

from ..configuration.mote import (
    GLM_OCR_MOTE_CONFIGS,
    TINY_GLM_OCR_MOTE,
    TINY_LLAMA_MOTE,
    TINY_VIDEOLLM_MOTE,
    VIDEOLLM_MOTE_CONFIGS,
)
from ..registry import Architecture, Converter, Preset


# The modeling module of each family.
VIDEO_LLM_MODELING = "moezoo.modeling.mote.video_llm"
GLM_OCR_MODELING = "moezoo.modeling.mote.glm_ocr"
LLAMA_MODELING = "moezoo.modeling.mote.llama"
PROCESSING = "moezoo.processors.mote"
BUILD = "moezoo.processors.build_mote"
# The Auto classes of the vision-language members (spec §2.8): AutoModelForMultimodalLM too, where transformers has it.
VLM_AUTO_CLASSES = ("AutoModelForImageTextToText",) + (
    ("AutoModelForMultimodalLM",) if hasattr(transformers, "AutoModelForMultimodalLM") else ()
)

ARCHITECTURES = [
    Architecture(
        name="videollm_mote",
        title="VideoLLM-MoTE",
        family="mote",
        config="moezoo.configuration.mote:VideoLlmMoteConfig",
        models={
            **dict.fromkeys(VLM_AUTO_CLASSES, f"{VIDEO_LLM_MODELING}:VideoLlmMoteForConditionalGeneration"),
            "AutoModel": f"{VIDEO_LLM_MODELING}:VideoLlmMoteModel",
        },
        processor=f"{PROCESSING}:VideoLlmMoteProcessor",
        processor_parts={"AutoImageProcessor": f"{PROCESSING}:VideoLlmMoteFrameProcessor"},
        make_processor=f"{BUILD}:make_videollm_mote_processor",
        pipeline_tag="video-text-to-text",
        model_card="mote.md",
        tags=("mote", "task-experts", "video", "llama"),
        # The paper's accounting (A.1) covers the language model; its LM head is tied to the embeddings.
        paper_counted_modules=("model.language_model",),
        sub_configs={"llama_mote": "moezoo.configuration.mote:LlamaMoteConfig"},
    ),
    Architecture(
        name="glm_ocr_mote",
        title="GLM-OCR-MoTE",
        family="mote",
        config="moezoo.configuration.mote:GlmOcrMoteConfig",
        models={
            **dict.fromkeys(VLM_AUTO_CLASSES, f"{GLM_OCR_MODELING}:GlmOcrMoteForConditionalGeneration"),
            "AutoModel": f"{GLM_OCR_MODELING}:GlmOcrMoteModel",
        },
        processor=f"{PROCESSING}:GlmOcrMoteProcessor",
        make_processor=f"{BUILD}:make_glm_ocr_mote_processor",
        pipeline_tag="image-text-to-text",
        model_card="mote.md",
        tags=("mote", "task-experts", "ocr", "glm_ocr"),
        paper_counted_modules=("model.language_model", "lm_head"),
        sub_configs={"glm_ocr_mote_text": "moezoo.configuration.mote:GlmOcrMoteTextConfig"},
        sub_models={"glm_ocr_mote_text": f"{GLM_OCR_MODELING}:GlmOcrMoteTextModel"},
    ),
    Architecture(
        name="llama_mote",
        title="Llama-MoTE",
        family="mote",
        config="moezoo.configuration.mote:LlamaMoteConfig",
        models={
            "AutoModelForCausalLM": f"{LLAMA_MODELING}:LlamaMoteForCausalLM",
            "AutoModel": f"{LLAMA_MODELING}:LlamaMoteModel",
        },
        tokenizer="transformers:AutoTokenizer",
        make_processor=f"{BUILD}:make_llama_mote_tokenizer",
        pipeline_tag="text-generation",
        model_card="mote.md",
        tags=("mote", "task-experts", "llama"),
    ),
]

PRESETS = [
    Preset(name="tiny-mote", architecture="videollm_mote", config=TINY_VIDEOLLM_MOTE, license="apache-2.0",
           description="tiny VideoLLM-MoTE (5 COIN task experts + shared, 2 layers); tests and the demo"),
    Preset(name="tiny-mote-glm-ocr", architecture="glm_ocr_mote", config=TINY_GLM_OCR_MOTE, license="apache-2.0",
           description="tiny GLM-OCR-MoTE (ocr + kie experts); tests"),
    Preset(name="tiny-mote-llama", architecture="llama_mote", config=TINY_LLAMA_MOTE, license="apache-2.0",
           description="tiny text-only Llama-MoTE; tests"),
    *(
        Preset(
            name=name.lower().replace("+", "-"), architecture="videollm_mote", config=config,
            description=f"{name} (paper Sec. 4.1/4.4): Llama-3.2-1B-Instruct + SigLIP 2 L/16-384",
            base_checkpoints=("meta-llama/Llama-3.2-1B-Instruct", "google/siglip2-large-patch16-384"),
            converter="mote-llama", license="llama3.2",
        )
        for name, config in VIDEOLLM_MOTE_CONFIGS.items()
    ),
    *(
        Preset(
            name=name.lower().replace("+", "-"), architecture="glm_ocr_mote", config=config,
            description=f"{name} (paper Sec. 4.5): GLM-OCR with OCR and receipt-KIE experts",
            base_checkpoints=("zai-org/GLM-OCR",), converter="mote-glm-ocr", license="mit",
        )
        for name, config in GLM_OCR_MOTE_CONFIGS.items()
    ),
]

CONVERTERS = [
    Converter(
        name="mote-llama",
        architecture="videollm_mote",
        sources=("llama",),
        function="moezoo.conversion.mote_llama:convert",
        plan="moezoo.conversion.mote_llama:plan_output",
        add_arguments="moezoo.conversion.mote_llama:add_arguments",
        description="Llama-3.2 + SigLIP 2 (--vision) -> VideoLLM-MoTE; every route reproduces the base at init",
    ),
    Converter(
        name="mote-llama-text",
        architecture="llama_mote",
        sources=("llama",),
        function="moezoo.conversion.mote_llama:convert",
        plan="moezoo.conversion.mote_llama:plan_output",
        add_arguments="moezoo.conversion.mote_llama:add_arguments",
        description="Llama (text only) -> Llama-MoTE; every route reproduces the base at init",
    ),
    Converter(
        name="mote-glm-ocr",
        architecture="glm_ocr_mote",
        sources=("glm_ocr",),
        function="moezoo.conversion.mote_glm_ocr:convert",
        plan="moezoo.conversion.mote_glm_ocr:plan_output",
        add_arguments="moezoo.conversion.mote_glm_ocr:add_arguments",
        description="GLM-OCR -> GLM-OCR-MoTE (decoder FFNs only; MTP layer dropped); exact at init",
    ),
]
