"""`config_common_kwargs`: a non-default value for every argument that `PreTrainedConfig` itself takes.

`ConfigTester.check_config_arguments_init` builds a config from these and checks each value is kept. transformers'
own dictionary lives in its repository's `tests/utils`, which the source distribution lacks; this one covers the
fields of transformers 5.24's `PreTrainedConfig` dataclass (`transformers_version` aside, which saving overwrites).
"""

config_common_kwargs = {
    "architectures": ["BertModel"],
    "output_hidden_states": True,
    "return_dict": False,
    "dtype": "float16",  # the tester compares it with torch.float16
    "chunk_size_feed_forward": 5,
    "is_encoder_decoder": True,
    "id2label": {0: "negative", 1: "positive"},
    "label2id": {"negative": 0, "positive": 1},
    "problem_type": "regression",
}
