"""transformers' `test_moe_models_record_router_logits`, run on the zoo's models with routed experts.

transformers runs that common test only where the model class's own file contains `@use_experts_implementation`,
its sign of a model with sparse experts; elsewhere the test skips itself ("This model has no sparse experts."). No zoo
modeling file passes that grep although every zoo MoE model has routed experts: the fused experts carry the decorator
in the shared core (`moezoo/modeling/moe/experts.py`), which the modeling files import, and MoTE's task experts are
whole FFNs, one per route. So the skip says nothing about the zoo's models. `RoutedExpertsTests`, placed before
`ModelTesterMixin` in the test class of a model with routed experts, runs the test's assertions without the grep.
"""

import copy
from typing import get_args

from transformers import PreTrainedModel


class RoutedExpertsTests:
    def test_moe_models_record_router_logits(self):
        """A model with routed experts records `router_logits` and declares them in the output of its generative
        heads, so that `output_router_logits=True` returns them (the assertions of transformers' common test)."""
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(copy.deepcopy(config))
            recordable_outputs = set().union(
                *(
                    (module._can_record_outputs or {}).keys()
                    for module in model.modules()
                    if isinstance(module, PreTrainedModel)
                )
            )
            self.assertIn("router_logits", recordable_outputs, f"{model_class.__name__} does not record them.")
            if model_class in self.all_generative_model_classes:
                return_type = model_class.forward.__annotations__.get("return")
                output_fields = set().union(
                    *(getattr(t, "__dataclass_fields__", {}).keys() for t in (get_args(return_type) or (return_type,)))
                )
                self.assertIn("router_logits", output_fields, f"{model_class.__name__} does not return them.")
