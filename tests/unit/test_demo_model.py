"""`andromeda up` reuses its cached demo model only when this version of the code loads it."""
from __future__ import annotations

import json

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from andromeda_cli.service import cached_model_loads
from andromeda_core.models.retrieval import RetrievalModel
from tests.unit.test_models import DIMS


def test_only_a_checkpoint_of_this_model_version_is_reused(tmp_path, capsys):
    good, old, junk = tmp_path / "good.safetensors", tmp_path / "old.safetensors", tmp_path / "junk.safetensors"
    RetrievalModel("moe", DIMS, [1, 2, 3]).save(good)
    with safe_open(str(good), framework="pt") as f:
        config = json.loads(f.metadata()["config"])
    save_file(load_file(str(good)), str(old), metadata={"config": json.dumps({**config, "model_version": "2"})})
    junk.write_text("not a checkpoint")
    assert cached_model_loads(good)
    assert not cached_model_loads(tmp_path / "missing.safetensors") and capsys.readouterr().err == ""
    assert not cached_model_loads(old) and "model version 2 is not" in capsys.readouterr().err
    assert not cached_model_loads(junk) and "not using the cached demo model" in capsys.readouterr().err
