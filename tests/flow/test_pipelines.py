"""What `lmrl.flow.pipelines.load_pipeline` says of a directory it cannot load: the file and
the problem, in one line."""

from __future__ import annotations

import pytest
import torch

from lmrl.errors import ModelError
from lmrl.flow.pipelines import load_pipeline


@pytest.mark.parametrize("name", ["model_index.json", "config.json"])
def test_a_model_file_that_is_not_json_is_named_with_its_parse_error(tmp_path, name):
    """A cut-short ``model_index.json`` is unreadable JSON (not "a pipeline of unknown kind");
    so is a cut-short ``config.json`` (not "a model model")."""
    (tmp_path / name).write_text('{"_class_name": "StableDiffusion3Pipeline",')
    with pytest.raises(ModelError) as err:
        load_pipeline(tmp_path, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith(f"cannot read {tmp_path / name}: not valid JSON (Expecting")
    assert "line 1 column" in message and "\n" not in message
