"""The zoo's model classes listed in transformers' model mappings while a common test runs.

transformers' common tests decide by class name what a model is: `_prepare_for_class` adds `labels` for the classes
in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, `test_causal_lm_loss_honors_shift_labels` checks the LM heads of
`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, several tests run on the base
models of `MODEL_MAPPING_NAMES` only. A model inside transformers is listed there; the zoo registers its classes with
the Auto classes instead (`import moezoo`), which leaves those name tables untouched. `ListedInTransformersMappings`
lists them, from the catalogue's Auto classes, for the duration of each test, so that every common test treats a zoo
class as it treats the transformers model it extends.
"""

from unittest import mock

import transformers

from moezoo.registry import ARCHITECTURES


def mapping_names(auto_class_name: str) -> dict:
    """The name table behind an Auto class, e.g. `AutoModelForCausalLM` -> `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`."""
    return getattr(transformers, auto_class_name)._model_mapping._model_mapping


def zoo_entries() -> dict[str, dict[str, str]]:
    """{Auto class name: {model_type: class name}} for every catalogued architecture and its sub-models."""
    entries: dict[str, dict[str, str]] = {}
    for architecture in ARCHITECTURES.values():
        for auto_class_name, class_path in architecture.models.items():
            class_name = class_path.rpartition(":")[2]
            entries.setdefault(auto_class_name, {})[architecture.name] = class_name
        for model_type, class_path in architecture.sub_models.items():
            entries.setdefault("AutoModel", {})[model_type] = class_path.rpartition(":")[2]
    return entries


class ListedInTransformersMappings:
    """A common-test mixin, placed before `ModelTesterMixin`: each test runs with the zoo's classes in transformers'
    model name tables."""

    def setUp(self):
        for auto_class_name, names in zoo_entries().items():
            patcher = mock.patch.dict(mapping_names(auto_class_name), names)
            patcher.start()
            self.addCleanup(patcher.stop)
        super().setUp()
