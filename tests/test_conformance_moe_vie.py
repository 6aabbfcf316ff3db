"""transformers' common model and configuration tests on the MoE-ViE classes, the way transformers' own
`tests/models/siglip2/test_modeling_siglip2.py` applies them to Siglip2: one tester per tower and one for the dual
encoder, on tiny configurations of the official MoE-ViE profile (2D RoPE, SwiGLU, causal text pooled at its EOS), and
again on the profile of upcycled SigLIP checkpoints.

Every skip names the Siglip2 test file's own skip it mirrors. Where a common test reads an output a dual encoder
does not have (the `logits` of each experts implementation, a per-video batch axis of packed frames), the test class
says what it compares instead.
"""

import unittest
from unittest.mock import patch

import torch
from parameterized import parameterized

from moezoo.configuration.moe_vie import MoeVieConfig, MoeVieTextConfig, MoeVieVisionConfig
from moezoo.modeling.moe_vie import MoeVieModel, MoeVieTextModel, MoeVieVisionModel
from transformers_tests.routed_experts import RoutedExpertsTests
from transformers_tests.test_configuration_common import ConfigTester
from transformers_tests import test_modeling_common
from transformers_tests.test_modeling_common import (
    TEST_EAGER_MATCHES_BATCHED_AND_GROUPED_INFERENCE_PARAMETERIZATION,
    ModelTesterMixin,
    floats_tensor,
    ids_tensor,
)


SIGLIP2_TESTS = "transformers' tests/models/siglip2/test_modeling_siglip2.py"

# The field values of SigLIP/SigLIP2 checkpoints upcycled to MoE-ViE (spec §5.1; `conversion/moe_vie_upcycle.py`):
# learned positions, GELU experts with biases scaled by top-k, post-LN, bidirectional text pooled at its last position,
# no projection of the image features, the sigmoid loss.
SIGLIP_PROFILE = dict(
    vision_config=dict(
        mlp_type="gelu", hidden_act="gelu_pytorch_tanh", position_embedding_type="learned", num_patches=16,
        use_pre_layernorm=False, use_post_layernorm=True, patch_embedding_bias=True, routed_scaling_factor=2.0,
        pooling_hidden_act="gelu_pytorch_tanh",
    ),
    text_config=dict(
        mlp_type="gelu", hidden_act="gelu_pytorch_tanh", is_causal=False, pooling_type="last",
        use_final_layer_norm=True,
    ),
    projection_dim=None,
    loss_type="sigmoid",
    max_logit_scale=None,
    text_projection_bias=True,
)


class SingleTowerSkips:
    """The skips of Siglip2's own vision and text tower tests, which MoE-ViE's towers share."""

    @unittest.skip(reason=f"a MoE-ViE tower takes no inputs_embeds, as {SIGLIP2_TESTS} skips it for Siglip2's towers")
    def test_inputs_embeds(self):
        pass

    @unittest.skip(reason=f"a single tower has no loss of its own to train on, as {SIGLIP2_TESTS} skips it")
    def test_training(self):
        pass

    @unittest.skip(reason=f"a single tower has no loss of its own to train on, as {SIGLIP2_TESTS} skips it")
    def test_training_gradient_checkpointing(self):
        pass

    @unittest.skip(reason=f"a single tower has no loss of its own to train on, as {SIGLIP2_TESTS} skips it")
    def test_training_gradient_checkpointing_use_reentrant_false(self):
        pass

    @unittest.skip(
        reason=f"a single tower has no loss of its own to train on, as {SIGLIP2_TESTS} skips it (there under its "
        "name before transformers 5.24, test_training_gradient_checkpointing_use_reentrant)"
    )
    def test_training_gradient_checkpointing_use_reentrant_true(self):
        pass


class MoeVieVisionModelTester:
    """Pre-patchified NaFlex batches (`pixel_values (B, N, p*p*C)`, `pixel_attention_mask`, `spatial_shapes`) of
    images with different patch grids, padded to `seq_length` patches, as Siglip2's tester makes them."""

    def __init__(
        self,
        parent,
        batch_size=12,
        seq_length=16,
        patch_size=2,
        num_channels=3,
        is_training=True,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,  # grouped_mm needs 16-byte aligned expert rows, in fp16 and bf16 too
        n_routed_experts=4,
        num_experts_per_tok=2,
        profile=None,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.is_training = is_training
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.profile = profile or {}  # further config fields
        # Grids of every aspect ratio, one of them filling all `seq_length` slots.
        self.spatial_shapes = [(4, 4), (2, 3), (3, 5), (1, 6), (5, 2), (1, 1)]

    def get_config(self):
        return MoeVieVisionConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_channels=self.num_channels,
            patch_size=self.patch_size,
            image_size=self.patch_size * 4,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=self.n_routed_experts,
            n_shared_experts=1,
            num_experts_per_tok=self.num_experts_per_tok,
            pooling_num_attention_heads=2,
            pooling_intermediate_size=37,
            **self.profile,
        )

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.seq_length, self.num_channels * self.patch_size**2])
        shapes = (self.spatial_shapes * self.batch_size)[: self.batch_size]
        spatial_shapes = torch.tensor(shapes, dtype=torch.long)
        pixel_attention_mask = torch.zeros(self.batch_size, self.seq_length, dtype=torch.long)
        for i, (rows, cols) in enumerate(shapes):
            pixel_attention_mask[i, : rows * cols] = 1
        return self.get_config(), pixel_values, pixel_attention_mask, spatial_shapes

    def create_and_check_model(self, config, pixel_values, pixel_attention_mask, spatial_shapes):
        model = MoeVieVisionModel(config).eval()
        with torch.no_grad():
            result = model(pixel_values, pixel_attention_mask, spatial_shapes)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(result.pooler_output.shape, (self.batch_size, self.hidden_size))

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values, pixel_attention_mask, spatial_shapes = self.prepare_config_and_inputs()
        inputs = {"pixel_values": pixel_values, "pixel_attention_mask": pixel_attention_mask,
                  "spatial_shapes": spatial_shapes}
        return config, inputs


class MoeVieVisionModelTest(SingleTowerSkips, RoutedExpertsTests, ModelTesterMixin, unittest.TestCase):
    all_model_classes = (MoeVieVisionModel,)
    # What the common tests that build their own batch (eager vs sdpa) pass besides `pixel_values`.
    additional_model_inputs = ["pixel_attention_mask", "spatial_shapes"]
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = MoeVieVisionModelTester(self)
        # Siglip2 passes hidden_size=37; MoE-ViE configs reject a width its heads do not divide.
        self.config_tester = ConfigTester(self, config_class=MoeVieVisionConfig, has_text_modality=False,
                                          hidden_size=48)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_model_get_set_embeddings(self):
        # Siglip2's own version: the input embedding of a pre-patchified tower is a Linear patch embedding.
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        model = MoeVieVisionModel(config)
        self.assertIs(model.get_input_embeddings(), model.embeddings.patch_embedding)
        self.assertIsNone(model.get_output_embeddings())


class MoeVieTextModelTester:
    """Texts of different lengths: random tokens, the EOS the towers pool, then padding."""

    def __init__(
        self,
        parent,
        batch_size=12,
        seq_length=7,
        is_training=True,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=16,
        profile=None,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.profile = profile or {}  # further config fields
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, vocab_size - 2, vocab_size - 1

    def get_config(self):
        return MoeVieTextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            **self.profile,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.bos_token_id - 1) + 1
        attention_mask = torch.zeros_like(input_ids)
        lengths = ids_tensor([self.batch_size], self.seq_length - 2) + 3  # bos, at least one token, eos
        lengths[0] = self.seq_length
        for i, length in enumerate(lengths.tolist()):
            input_ids[i, 0], input_ids[i, length - 1] = self.bos_token_id, self.eos_token_id
            input_ids[i, length:] = self.pad_token_id
            attention_mask[i, :length] = 1
        return self.get_config(), input_ids, attention_mask

    def create_and_check_model(self, config, input_ids, attention_mask):
        model = MoeVieTextModel(config).eval()
        with torch.no_grad():
            result = model(input_ids, attention_mask=attention_mask)
            result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))
        self.parent.assertEqual(result.pooler_output.shape, (self.batch_size, self.hidden_size))

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class MoeVieTextModelTest(SingleTowerSkips, ModelTesterMixin, unittest.TestCase):
    all_model_classes = (MoeVieTextModel,)
    test_resize_embeddings = False

    def setUp(self):
        self.model_tester = MoeVieTextModelTester(self)
        self.config_tester = ConfigTester(self, config_class=MoeVieTextConfig, hidden_size=48)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())


class MoeVieVideoTester:
    """Videos of `num_frames` frames, the later frames of some of them padding, each video with one patch grid."""

    def __init__(self, vision_model_tester, num_frames=3):
        self.vision_model_tester = vision_model_tester
        self.num_frames = num_frames

    def prepare_config_and_inputs_for_common(self):
        tester = self.vision_model_tester
        config, _, _, spatial_shapes = tester.prepare_config_and_inputs()
        batch_size, num_frames = tester.batch_size, self.num_frames
        patch_dim = tester.num_channels * tester.patch_size**2
        pixel_values = floats_tensor([batch_size, num_frames, tester.seq_length, patch_dim])
        pixel_attention_mask = torch.zeros(batch_size, num_frames, tester.seq_length, dtype=torch.long)
        for i, (rows, cols) in enumerate(spatial_shapes.tolist()):
            pixel_attention_mask[i, :, : rows * cols] = 1
        padding_mask = torch.ones(batch_size, num_frames, dtype=torch.long)
        padding_mask[::2, 1:] = 0  # every other video has a single real frame
        inputs = {
            "pixel_values_videos": pixel_values,
            "video_pixel_attention_mask": pixel_attention_mask,
            "video_spatial_shapes": spatial_shapes,
            "padding_mask_videos": padding_mask,
        }
        return config, inputs


class MoeVieModelTester:
    def __init__(self, parent, is_training=True, profile=None):
        profile = dict(profile or {})
        self.parent = parent
        self.text_model_tester = MoeVieTextModelTester(parent, profile=profile.pop("text_config", None))
        self.vision_model_tester = MoeVieVisionModelTester(parent, profile=profile.pop("vision_config", None))
        self.profile = {"projection_dim": 24} | profile
        self.video_model_tester = MoeVieVideoTester(self.vision_model_tester)
        self.batch_size = self.text_model_tester.batch_size  # for test_batching_equivalence
        self.is_training = is_training

    def get_config(self):
        return MoeVieConfig(
            text_config=self.text_model_tester.get_config().to_dict(),
            vision_config=self.vision_model_tester.get_config().to_dict(),
            **self.profile,
        )

    def prepare_config_and_inputs(self):
        _, input_ids, attention_mask = self.text_model_tester.prepare_config_and_inputs()
        _, pixel_values, pixel_attention_mask, spatial_shapes = self.vision_model_tester.prepare_config_and_inputs()
        return self.get_config(), input_ids, attention_mask, pixel_values, pixel_attention_mask, spatial_shapes

    def create_and_check_model(
        self, config, input_ids, attention_mask, pixel_values, pixel_attention_mask, spatial_shapes
    ):
        model = MoeVieModel(config).eval()
        with torch.no_grad():
            result = model(input_ids, pixel_values, pixel_attention_mask, spatial_shapes, attention_mask)
        num_images, num_texts = self.vision_model_tester.batch_size, self.text_model_tester.batch_size
        self.parent.assertEqual(result.logits_per_image.shape, (num_images, num_texts))
        self.parent.assertEqual(result.logits_per_text.shape, (num_texts, num_images))

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask, pixel_values, pixel_attention_mask, spatial_shapes = (
            self.prepare_config_and_inputs()
        )
        inputs = {
            "input_ids": input_ids,
            "pixel_values": pixel_values,
            "pixel_attention_mask": pixel_attention_mask,
            "spatial_shapes": spatial_shapes,
            "attention_mask": attention_mask,
        }
        return config, inputs


class MoeVieModelTest(RoutedExpertsTests, ModelTesterMixin, unittest.TestCase):
    all_model_classes = (MoeVieModel,)
    additional_model_inputs = ["pixel_values", "pixel_attention_mask", "spatial_shapes"]
    test_resize_embeddings = False
    _is_composite = True
    # The vision tower runs the real frames of all videos as one batch (padded frames are never computed), so the
    # video features' `last_hidden_state` holds one row per real frame, not per video; transformers' models that pack
    # frames set the same flag.
    skip_test_video_features_output_shape = True

    def setUp(self):
        self.model_tester = MoeVieModelTester(self)
        self.config_tester = ConfigTester(self, config_class=MoeVieConfig, has_text_modality=False)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # The dual encoder's "labels" are the matching pairs of its batch: the training tests ask for its loss.
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels:
            inputs_dict["return_loss"] = True
        return inputs_dict

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    @parameterized.expand(TEST_EAGER_MATCHES_BATCHED_AND_GROUPED_INFERENCE_PARAMETERIZATION)
    def test_eager_matches_batched_and_grouped_inference(self, name, dtype):
        # The common test compares the `logits` or `last_hidden_state` of each experts implementation; a dual
        # encoder's output has its logits per image and its towers' last hidden states instead.
        def output_tensors(outputs):
            return [outputs.logits_per_image, outputs.vision_model_output.last_hidden_state,
                    outputs.text_model_output.last_hidden_state]

        with patch.object(test_modeling_common, "_get_output_tensors", output_tensors):
            test_modeling_common._test_eager_matches_batched_and_grouped_inference(self, name, dtype)

    @unittest.skip(reason=f"the towers' attentions are tested in their own test classes, as {SIGLIP2_TESTS} does "
                          "(test_attention_outputs = False)")
    def test_attention_outputs(self):
        pass

    @unittest.skip(reason=f"the towers' hidden states are tested in their own test classes, as {SIGLIP2_TESTS} does")
    def test_hidden_states_output(self):
        pass

    @unittest.skip(reason=f"retain_grad is tested in the towers' own test classes, as {SIGLIP2_TESTS} skips it")
    def test_retain_grad_hidden_states_attentions(self):
        pass


class MoeVieSiglipProfileVisionModelTest(MoeVieVisionModelTest):
    """The vision tower of upcycled SigLIP checkpoints."""

    def setUp(self):
        super().setUp()
        self.model_tester = MoeVieVisionModelTester(self, profile=SIGLIP_PROFILE["vision_config"])


class MoeVieSiglipProfileTextModelTest(MoeVieTextModelTest):
    """The text tower of upcycled SigLIP checkpoints."""

    def setUp(self):
        super().setUp()
        self.model_tester = MoeVieTextModelTester(self, profile=SIGLIP_PROFILE["text_config"])


class MoeVieSiglipProfileModelTest(MoeVieModelTest):
    """The dual encoder of upcycled SigLIP checkpoints."""

    def setUp(self):
        super().setUp()
        self.model_tester = MoeVieModelTester(self, profile=SIGLIP_PROFILE)
