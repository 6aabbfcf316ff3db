"""`GenerationTesterMixin`: the zoo's own generation checks, under the name `ModelTesterMixin` looks for.

transformers' generation tests live in its repository's `tests/generation`, which the source distribution lacks. These
checks cover what a user of `generate()` relies on, for every class in `all_generative_model_classes`:
cache vs no cache, the old (`past_key_values`) and new (`cache`) names of the cache argument, left-padded batches,
beam search, `return_dict_in_generate` outputs, and `generate` after `save_pretrained` / `from_pretrained`.

A test class provides `model_tester.prepare_config_and_inputs_for_common()` as for `ModelTesterMixin`; the prompt's
text is `input_ids` (with `attention_mask`), and every other input (pixels, tasks, ...) is passed to `generate` as is;
inputs with one entry per token (`(batch, sequence, ...)` like `input_ids`, e.g. `mm_token_type_ids`) are padded and
extended with zeros (text) along with the tokens. As in transformers' own generation tests, the multimodal
placeholder tokens of the config (`image_token_id`, `video_token_id`, ...) are never generated: a generated
placeholder would ask for media that is not there.
"""

import copy
import tempfile
import warnings

import torch

from transformers.cache_utils import Cache


NEW_TOKENS = 4
# Special tokens of the text; every other `*_token_id` of a config marks media (placeholders, media start and end).
TEXT_SPECIAL_TOKENS = {"pad", "bos", "eos", "sep", "cls", "mask", "unk", "decoder_start"}


class GenerationTesterMixin:
    all_generative_model_classes = ()

    def _generation_setup(self, model_class):
        """A model in eval mode and its prompt inputs (without labels), drawn from the model tester."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        inputs = {key: value for key, value in inputs.items() if key not in ("labels", "use_cache")}
        inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))
        torch.manual_seed(0)
        model = model_class(config).eval()
        # A token that is never produced lets every run generate exactly NEW_TOKENS tokens.
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = self._pad_token_id(config)
        model.generation_config.suppress_tokens = self._media_token_ids(config) or None
        return model, inputs

    @staticmethod
    def _pad_token_id(config) -> int:
        text_config = config.get_text_config(decoder=True)
        pad = getattr(text_config, "pad_token_id", None)
        return 0 if pad is None else pad

    @staticmethod
    def _media_token_ids(config) -> list[int]:
        vocab_size = config.get_text_config(decoder=True).vocab_size
        return sorted({
            value for name, value in config.to_dict().items()
            if name.endswith("_token_id") and name.removesuffix("_token_id") not in TEXT_SPECIAL_TOKENS
            and isinstance(value, int) and 0 <= value < vocab_size
        })

    @staticmethod
    def _per_token_inputs(inputs) -> list[str]:
        """The inputs other than the text and its mask with one entry per token."""
        shape = inputs["input_ids"].shape
        return [
            key for key, value in inputs.items()
            if key not in ("input_ids", "attention_mask") and torch.is_tensor(value) and value.shape[:2] == shape
        ]

    @classmethod
    def _with_tokens(cls, inputs, before=0, after=0, token_id=0):
        """`inputs` with `before` masked `token_id` tokens before each prompt and `after` unmasked ones after it; the
        other per-token inputs get zeros there."""

        def around(value, first, last):
            batch, rest = value.shape[0], value.shape[2:]
            return torch.cat(
                [value.new_full((batch, before, *rest), first), value, value.new_full((batch, after, *rest), last)], 1
            )

        extended = {key: around(inputs[key], 0, 0) for key in cls._per_token_inputs(inputs)}
        extended["input_ids"] = around(inputs["input_ids"], token_id, token_id)
        extended["attention_mask"] = around(inputs["attention_mask"], 0, 1)
        return {**inputs, **extended}

    @staticmethod
    def _greedy(model, inputs, **options):
        options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, **options}
        with torch.no_grad():
            return model.generate(**inputs, **options)

    def _new_tokens(self, sequences, inputs):
        return sequences[:, inputs["input_ids"].shape[1]:]

    def test_generate_with_and_without_cache(self):
        for model_class in self.all_generative_model_classes:
            with self.subTest(model_class.__name__):
                model, inputs = self._generation_setup(model_class)
                cached = self._greedy(model, inputs, use_cache=True)
                recomputed = self._greedy(model, inputs, use_cache=False)
                self.assertEqual(cached.shape[1], inputs["input_ids"].shape[1] + NEW_TOKENS)
                torch.testing.assert_close(cached, recomputed, rtol=0, atol=0)

    def test_forward_continues_from_cache_under_both_names(self):
        """A cache passed as `cache` or under the deprecated `past_key_values` gives the logits of the full forward."""
        for model_class in self.all_generative_model_classes:
            with self.subTest(model_class.__name__):
                model, inputs = self._generation_setup(model_class)
                full_inputs = self._with_tokens(inputs, after=1, token_id=self._pad_token_id(model.config) + 1)
                with torch.no_grad():
                    full = model(**full_inputs).logits[:, -1]
                    prefill = model(**inputs, use_cache=True)
                    self.assertIsInstance(prefill.cache, Cache)
                    for name in ("cache", "past_key_values"):
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            step = model(
                                input_ids=full_inputs["input_ids"][:, -1:],
                                attention_mask=full_inputs["attention_mask"],
                                use_cache=True,
                                **{name: copy.deepcopy(prefill.cache)},
                            )
                        torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-4, atol=1e-5, msg=name)

    def test_left_padded_batch_matches_unpadded(self):
        """Left padding the prompts (masked pad tokens before each of them) changes no generated token."""
        for model_class in self.all_generative_model_classes:
            with self.subTest(model_class.__name__):
                model, inputs = self._generation_setup(model_class)
                unpadded = self._new_tokens(self._greedy(model, inputs), inputs)
                padded_inputs = self._with_tokens(inputs, before=3, token_id=self._pad_token_id(model.config))
                padded = self._new_tokens(self._greedy(model, padded_inputs), padded_inputs)
                torch.testing.assert_close(padded, unpadded, rtol=0, atol=0)

    def test_beam_search(self):
        """Beams return `num_return_sequences` ranked sequences per prompt; one beam is greedy search."""
        for model_class in self.all_generative_model_classes:
            with self.subTest(model_class.__name__):
                model, inputs = self._generation_setup(model_class)
                batch = inputs["input_ids"].shape[0]
                with torch.no_grad():
                    beams = model.generate(
                        **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=3, num_return_sequences=2,
                        return_dict_in_generate=True, output_scores=True,
                    )
                self.assertEqual(beams.sequences.shape, (batch * 2, inputs["input_ids"].shape[1] + NEW_TOKENS))
                scores = beams.sequences_scores.view(batch, 2)
                self.assertTrue(bool((scores[:, 0] >= scores[:, 1]).all()), scores)
                one_beam = self._greedy(model, inputs, num_beams=1)
                torch.testing.assert_close(one_beam, self._greedy(model, inputs), rtol=0, atol=0)
                uncached = model.generate(
                    **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=3, num_return_sequences=2,
                    use_cache=False,
                )
                torch.testing.assert_close(uncached, beams.sequences, rtol=0, atol=0)

    def test_generate_dict_outputs(self):
        """`return_dict_in_generate` returns one score, logit and hidden-state entry per generated token."""
        for model_class in self.all_generative_model_classes:
            with self.subTest(model_class.__name__):
                model, inputs = self._generation_setup(model_class)
                output = self._greedy(
                    model, inputs, return_dict_in_generate=True, output_scores=True, output_logits=True,
                    output_hidden_states=True,
                )
                torch.testing.assert_close(output.sequences, self._greedy(model, inputs), rtol=0, atol=0)
                vocab = model.config.get_text_config(decoder=True).vocab_size
                batch = inputs["input_ids"].shape[0]
                self.assertEqual(len(output.scores), NEW_TOKENS)
                self.assertEqual(len(output.logits), NEW_TOKENS)
                self.assertEqual(len(output.hidden_states), NEW_TOKENS)
                for step, (logits, scores) in enumerate(zip(output.logits, output.scores)):
                    self.assertEqual(tuple(logits.shape), (batch, vocab))
                    # greedy search picks the highest score (the logits after the processors, which suppress tokens)
                    new_token = output.sequences[:, inputs["input_ids"].shape[1] + step]
                    torch.testing.assert_close(new_token, scores.argmax(-1), rtol=0, atol=0)
                self.assertIsInstance(output.past_key_values if "past_key_values" in output else output.cache, Cache)

    def test_generate_after_save_and_reload(self):
        for model_class in self.all_generative_model_classes:
            with self.subTest(model_class.__name__):
                model, inputs = self._generation_setup(model_class)
                before = self._greedy(model, inputs)
                with tempfile.TemporaryDirectory() as folder:
                    model.save_pretrained(folder)
                    reloaded = model_class.from_pretrained(folder).eval()
                reloaded.generation_config.eos_token_id = None
                reloaded.generation_config.pad_token_id = model.generation_config.pad_token_id
                torch.testing.assert_close(self._greedy(reloaded, inputs), before, rtol=0, atol=0)
