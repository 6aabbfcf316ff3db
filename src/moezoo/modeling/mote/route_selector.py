"""Prompt-conditioned route selection for MoTE (spec mote.md §2.4, §6.4; paper Sec. 3.2 and A.6).

A registry maps each expert (route) name to a natural-language description ("predict the next step"). A frozen
sentence encoder embeds the user prompt and every description; the route is the description nearest to the prompt
by cosine similarity:

    r(x) = argmax_m  phi(x) . e_m,      e_m = phi(d_m) / |phi(d_m)|,   phi(x) normalised too

The encoder is a transformers `AutoModel` with attention-masked mean pooling and L2 normalisation, which is what
sentence-transformers computes for `sentence-transformers/all-MiniLM-L6-v2`, the paper's encoder (6 BERT layers,
384-d). The route embeddings `e_m` are computed once and cached (384 fp32 values, 1.5 KiB each), so a selection
encodes the prompt only. Adding or removing a route never touches the decoder.

A route may also be given example prompts (spec §10 A12; the paper split 35 "training" paraphrases per intent off its
test prompts). Its embedding is then the prototype `e_m = normalise(mean(phi(d_m), phi(example_1), ...))` of its
unit-norm description and example embeddings. Near-synonymous intents ("the next step" against "the next steps")
are told apart much better this way than by one short description.

The paper always takes the nearest route. `min_similarity` adds a floor: below it the selector returns
`default_route`, or raises when there is none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import AutoModel, AutoTokenizer

from ...hub.sources import MODEL_FILES, locate, source_name


DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
# all-MiniLM-L6-v2 truncates at 256 word pieces (its sentence-transformers `max_seq_length`).
DEFAULT_MAX_LENGTH = 256
DESCRIPTIONS_FILE = "descriptions.json"
EMBEDDINGS_FILE = "description_embeddings.safetensors"


def load_encoder(name_or_path: str | Path):
    """The sentence encoder `name_or_path` (a folder or a Hub id) and its tokenizer. Offline, a Hub id not in the Hub
    cache fails at once with `moezoo.hub.sources.HubUnreachableError` (an `OSError`) naming it, not after minutes of
    retries."""
    folder = locate(
        name_or_path, "the route selector's sentence-embedding model",
        "pass encoder= a local folder of it (for the paper's, a copy of sentence-transformers/all-MiniLM-L6-v2)",
        MODEL_FILES,
    )
    return AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


class MoteRouteSelector:
    r"""
    Chooses a MoTE route from the user prompt: the route whose description (and examples) is nearest.

    Args:
        encoder ([`PreTrainedModel`]):
            A text encoder whose `last_hidden_state` is mean-pooled; frozen here.
        tokenizer ([`PreTrainedTokenizerBase`]):
            The encoder's tokenizer.
        descriptions (`Mapping[str, str]`, *optional*):
            Route name -> description, in route order (the order of the model's `mote_expert_names`).
        examples (`Mapping[str, Sequence[str]]`, *optional*):
            Route name -> example prompts of that route.
        min_similarity (`float`, *optional*):
            Cosine similarity below which a prompt matches no route.
        default_route (`str`, *optional*):
            The route of prompts below `min_similarity`; without it they raise.
        max_length (`int`, *optional*, defaults to 256):
            Longer prompts are truncated to this many tokens.

    Example:

    ```python
    >>> selector = MoteRouteSelector.from_encoder({"step": "recognize the current action step in the video",
    ...                                            "task": "identify the overall procedure"})
    >>> selector.select(["Which procedure is this video about?"])
    tensor([1])
    ```
    """

    def __init__(
        self,
        encoder,
        tokenizer,
        descriptions: Mapping[str, str] | None = None,
        examples: Mapping[str, Sequence[str]] | None = None,
        min_similarity: float | None = None,
        default_route: str | None = None,
        max_length: int = DEFAULT_MAX_LENGTH,
    ):
        self.encoder = encoder.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.min_similarity = min_similarity
        self.default_route = default_route
        self._descriptions: dict[str, str] = {}
        self._examples: dict[str, list[str]] = {}
        self.embeddings = torch.zeros(0, encoder.config.hidden_size)
        descriptions, examples = descriptions or {}, examples or {}
        unknown = sorted(set(examples) - set(descriptions))
        if unknown:
            raise ValueError(f"Examples are given for routes without a description: {unknown}.")
        for name, description in descriptions.items():
            self.add(name, description, examples.get(name, ()))
        self._check_default_route()

    @classmethod
    def from_encoder(
        cls, descriptions: Mapping[str, str] | None = None, encoder: str = DEFAULT_ENCODER, **kwargs
    ) -> MoteRouteSelector:
        """Load the encoder `encoder` (a Hub id or a folder) with `AutoModel` and build a selector with it."""
        return cls(*load_encoder(encoder), descriptions, **kwargs)

    @classmethod
    def from_config(
        cls, config, encoder: str = DEFAULT_ENCODER, examples: Mapping[str, Sequence[str]] | None = None, **kwargs
    ) -> MoteRouteSelector:
        """A selector over the routes of a MoTE model's config: `mote_expert_names` in route order, each with its
        description from `mote_expert_descriptions`."""
        text_config = config.get_text_config()
        descriptions = text_config.mote_expert_descriptions
        missing = [name for name in text_config.mote_expert_names if name not in descriptions]
        if missing:
            raise ValueError(
                f"The experts {missing} have no description in mote_expert_descriptions: describe them (e.g. "
                "model.add_expert(..., description=...)) or build the selector from your own descriptions."
            )
        ordered = {name: descriptions[name] for name in text_config.mote_expert_names}
        return cls.from_encoder(ordered, encoder=encoder, examples=examples, **kwargs)

    @property
    def names(self) -> list[str]:
        """Route names in route order."""
        return list(self._descriptions)

    @property
    def descriptions(self) -> dict[str, str]:
        return dict(self._descriptions)

    @property
    def examples(self) -> dict[str, list[str]]:
        return {name: list(examples) for name, examples in self._examples.items()}

    @torch.no_grad()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """Unit-norm fp32 embeddings `(len(texts), hidden_size)`: the attention-masked mean of the last hidden state."""
        inputs = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.encoder.device)
        hidden = self.encoder(**inputs).last_hidden_state.float()
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, dim=-1).cpu()

    def add(self, name: str, description: str, examples: Sequence[str] = ()) -> None:
        """Register route `name` after the existing ones; only its description and examples are encoded."""
        if name in self._descriptions:
            raise ValueError(f"Route {name!r} is registered already ({self._descriptions[name]!r}); remove it first.")
        if not description.strip():
            raise ValueError(f"The description of route {name!r} is empty.")
        examples = [examples] if isinstance(examples, str) else list(examples)
        prototype = F.normalize(self.embed([description, *examples]).mean(dim=0), dim=-1)
        self.embeddings = torch.cat([self.embeddings, prototype[None]])
        self._descriptions[name] = description
        self._examples[name] = examples

    def remove(self, name: str) -> None:
        """Unregister route `name`; the routes after it move down by one, as the model's route ids do."""
        if name not in self._descriptions:
            raise KeyError(f"Route {name!r} is not registered; the routes are {self.names}.")
        if name == self.default_route:
            raise ValueError(f"Route {name!r} is the default route: set another `default_route` (or None) first.")
        index = self.names.index(name)
        self.embeddings = torch.cat([self.embeddings[:index], self.embeddings[index + 1 :]])
        del self._descriptions[name], self._examples[name]

    def scores(self, prompts: str | list[str]) -> torch.Tensor:
        """Cosine similarities `(prompts, routes)` between every prompt and every route embedding."""
        if not self._descriptions:
            raise ValueError("No route is registered: add one with `selector.add(name, description)`.")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self.embed(prompts) @ self.embeddings.T

    def select(self, prompts: str | list[str]) -> torch.LongTensor:
        """
        The route id of every prompt: its nearest route (the lowest id on a tie, as `torch.argmax`). Prompts whose
        best similarity is below `min_similarity` get `default_route`, or raise a `ValueError` without one.
        """
        scores = self.scores(prompts)
        routes = scores.argmax(dim=-1)
        if self.min_similarity is None:
            return routes
        best = scores.gather(-1, routes[:, None]).squeeze(-1)
        below = best < self.min_similarity
        if not below.any():
            return routes
        if self.default_route is None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            index = int(below.nonzero()[0])
            nearest = self.names[int(routes[index])]
            raise ValueError(
                f"The prompt {prompts[index]!r} matches no route: the nearest, {nearest!r} "
                f"({self._descriptions[nearest]!r}), is at cosine similarity {float(best[index]):.3f}, below "
                f"min_similarity={self.min_similarity}. Rephrase the prompt, register a route that covers it "
                "(selector.add(name, description, examples)), lower min_similarity, or set a default_route."
            )
        return routes.masked_fill(below, self.names.index(self.default_route))

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the registry, the settings, the encoder's name and the cached route embeddings `(routes, d)`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        settings = {
            "descriptions": self._descriptions,
            "examples": self._examples,
            "min_similarity": self.min_similarity,
            "default_route": self.default_route,
            "max_length": self.max_length,
            "encoder": source_name(self.encoder.name_or_path),  # a Hub id, not its folder in this machine's cache
        }
        (folder / DESCRIPTIONS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        save_file({"embeddings": self.embeddings.contiguous()}, folder / EMBEDDINGS_FILE)

    @classmethod
    def from_pretrained(cls, folder: str | Path, encoder=None, tokenizer=None) -> MoteRouteSelector:
        """
        Load a saved selector. The encoder named in it is loaded unless `encoder` and `tokenizer` are given; the
        cached route embeddings are used as saved (nothing is re-encoded).
        """
        folder = Path(folder)
        settings = json.loads((folder / DESCRIPTIONS_FILE).read_text())
        if encoder is None:
            encoder, tokenizer = load_encoder(settings["encoder"])
        embeddings = load_file(folder / EMBEDDINGS_FILE)["embeddings"]
        if embeddings.shape != (len(settings["descriptions"]), encoder.config.hidden_size):
            raise ValueError(
                f"{folder / EMBEDDINGS_FILE} holds embeddings of shape {tuple(embeddings.shape)}, not one "
                f"{encoder.config.hidden_size}-d row per route ({len(settings['descriptions'])}): it was saved with "
                "another encoder or edited by hand."
            )
        selector = cls(encoder, tokenizer, min_similarity=settings["min_similarity"], max_length=settings["max_length"])
        selector._descriptions = dict(settings["descriptions"])
        selector._examples = {name: list(examples) for name, examples in settings["examples"].items()}
        selector.embeddings = embeddings
        selector.default_route = settings["default_route"]
        selector._check_default_route()
        return selector

    def _check_default_route(self) -> None:
        if self.default_route is not None and self.default_route not in self._descriptions:
            raise ValueError(f"default_route {self.default_route!r} is not a registered route ({self.names}).")
