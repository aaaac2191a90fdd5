import importlib


def test_import_has_no_side_effects_on_transformers():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    importlib.import_module("toptheta")
    assert "toptheta" not in ALL_ATTENTION_FUNCTIONS._global_mapping
