"""
Live video narration with VideoLLM-MoTE (spec §6.1 "Streaming inference", VideoLLM-online's protocol).

Frames arrive one at a time and go into the KV cache as the model was trained on them (`,` then the frame's `<v>`
placeholders). After each frame the model either predicts the silence token and stays quiet, or speaks: the stream
is closed with `]\\nAssistant:`, the answer is decoded greedily to the end-of-turn token and the stream reopens with
`\\n[`. The route is fixed for the whole session (spec A20).

    stream = VideoLlmMoteStream(model, processor, prompt=task_prompt("ego4d_narration"), task="ego4d_narration")
    for frame in camera:
        narration = stream.step(frame)  # None while the model stays silent
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .video_llm import VideoLlmMoteForConditionalGeneration


class VideoLlmMoteStream:
    """
    One live session of a [`VideoLlmMoteForConditionalGeneration`] over a stream of frames.

    Args:
        model: The model (put in eval mode).
        processor: Its `VideoLlmMoteProcessor`; frames are letterboxed and normalised as for training, one by one.
        prompt: The user prompt that opens the session (the A.5 narration prompt for Ego4D).
        task: The route, a task name of the model; default the model's default route.
        silence_threshold: A frame is silent when the silence token is the most likely next token or, with a
            threshold, when its probability reaches it (lower thresholds make the model speak less often).
        max_new_tokens: The longest answer; an answer cut there is still closed with the end-of-turn token.
        system_prompt: Default the processor's.

    `silence_probabilities` holds, for every frame so far, the probability the model gave the silence token.
    """

    def __init__(
        self,
        model: VideoLlmMoteForConditionalGeneration,
        processor,
        prompt: str,
        task: str | None = None,
        silence_threshold: float | None = None,
        max_new_tokens: int = 64,
        system_prompt: str | None = None,
    ):
        if silence_threshold is not None and not 0 < silence_threshold <= 1:
            raise ValueError(f"silence_threshold must be in (0, 1], got {silence_threshold}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.model, self.processor = model.eval(), processor
        self.silence_threshold, self.max_new_tokens = silence_threshold, max_new_tokens
        self.silence_id = processor.silence_token_id(model.config.stream_silence_token)
        self.end_of_turn_id = processor.tokenizer.eos_token_id
        route = processor.route_ids(task, None, [prompt])
        self.task_ids = None if route is None else torch.tensor(route, device=model.device)
        self.cache = DynamicCache(config=model.config.get_text_config())
        # Tokens decided but not yet run through the model; they go in with the next frame.
        self.pending = processor.stream_opening_ids(prompt, system_prompt)
        self.frames_in_chunk = 0
        self.token_ids: list[int] = []  # everything the model has read, in order
        self.silence_probabilities: list[float] = []

    @torch.no_grad()
    def step(self, frame) -> str | None:
        """Read one frame (an image: PIL, or an (H, W, 3) array); return what the model says after it, or None."""
        pixel_values = self.processor.image_processor([[frame]], return_tensors="pt")["pixel_values_videos"]
        separator = [self.processor.frame_interval_token_id] if self.frames_in_chunk else []
        frame_ids = separator + [self.processor.video_token_id] * self.processor.frame_num_tokens
        logits = self.read(self.pending + frame_ids, pixel_values)
        self.pending, self.frames_in_chunk = [], self.frames_in_chunk + 1
        probabilities = logits.float().softmax(-1)
        self.silence_probabilities.append(float(probabilities[self.silence_id]))
        if self.is_silent(probabilities):
            return None
        return self.respond()

    def is_silent(self, probabilities: torch.Tensor) -> bool:
        if self.silence_threshold is None:
            return int(probabilities.argmax()) == self.silence_id
        return float(probabilities[self.silence_id]) >= self.silence_threshold

    def respond(self) -> str:
        """Close the stream, decode an answer greedily, and leave the end of turn and the reopening pending."""
        logits = self.read(self.processor.text_ids(self.processor.response_header))
        answer: list[int] = []
        while len(answer) < self.max_new_tokens:
            token = int(logits.argmax())
            if token == self.end_of_turn_id:
                break
            answer.append(token)
            logits = self.read([token])
        self.pending = [self.end_of_turn_id] + self.processor.text_ids(self.processor.stream_reopening)
        self.frames_in_chunk = 0
        return self.processor.tokenizer.decode(answer, skip_special_tokens=True).strip()

    def read(self, token_ids: list[int], pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """Run `token_ids` (and a frame's pixels) through the model on top of the cache; the next-token logits."""
        self.token_ids += token_ids
        outputs = self.model(
            input_ids=torch.tensor([token_ids], device=self.model.device),
            pixel_values_videos=None if pixel_values is None else pixel_values.to(self.model.device),
            cache=self.cache,
            use_cache=True,
            task_ids=self.task_ids,
            logits_to_keep=1,
        )
        self.cache = outputs.cache
        return outputs.logits[0, -1]


__all__ = ["VideoLlmMoteStream"]
