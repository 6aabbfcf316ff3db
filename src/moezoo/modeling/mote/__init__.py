"""MoTE: decoders whose FFNs are named task experts plus a shared expert, one route per example (spec mote.md §2).

Only the FFN of a converted decoder layer changes; everything else is transformers' own classes. One module per
family, on what they share:

    common.py           MoteFeedForward (replaces `layer.mlp`: experts[name], one FFN per task, + shared_expert),
                        the text model (MoteTextModelMixin: built from a family's decoder layer, norm and rotary
                        classes; route resolution), the LM heads' losses and outputs, expert management, generation
                        with fixed routes, the output dataclasses
    llama.py            LlamaMoteForCausalLM: Llama with MoTE layers (text only; also VideoLLM-MoTE's decoder)
    video_llm.py        VideoLlmMoteForConditionalGeneration: SigLIP vision tower -> frame tokens -> 2-layer
                        projector -> LlamaMote
    glm_ocr.py          GlmOcrMoteForConditionalGeneration: GLM-OCR (CogViT + merger, unchanged) with a MoTE decoder
    route_selector.py   MoteRouteSelector: routes chosen from the user's prompt by a frozen sentence encoder
    streaming.py        VideoLlmMoteStream: live video narration, frame by frame

Import the classes from their modules (`from moezoo.modeling.mote.llama import LlamaMoteForCausalLM`): the Hub
export flattens each module into its own file and copies no package `__init__`.
"""
