import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import char_tokenizer, tiny_gemma3, tiny_llama  # noqa: E402

torch.set_num_threads(max(1, torch.get_num_threads()))

TINY = {"llama": tiny_llama, "gemma3": tiny_gemma3}
# KVSTACK_TEST_DEVICE=cuda runs the tiny-model fixtures on a GPU (the cache and methods follow the model's device)
DEVICE = os.environ.get("KVSTACK_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def private_calibrations(tmp_path_factory):
    """Head calibrations and predictors of the tiny models go to a temporary folder, never the user's cache."""
    folder = tmp_path_factory.mktemp("kvstack-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSTACK_CALIBRATION", str(folder))
        from kvstack.training.train import train

        for build in TINY.values():  # learned scorers find a predictor for each tiny model
            for method in ("kvzap", "retention", "wgkv", "sinkgate"):
                train(build(), method, texts=2, held=1, tokens=64, hidden=8, steps=20)
        yield


@pytest.fixture(scope="session", params=list(TINY))
def tiny(request):
    """A tiny random model (float32, kvstack attention), once per architecture."""
    return TINY[request.param]().to(DEVICE)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def wide(request):
    """Tiny models with heads wide enough for the kernels (64 and 128 channels: 16 and 32 bytes at 2 bits)."""
    return tiny_llama(head_dim=64) if request.param == "llama" else tiny_gemma3(head_dim=128)


@pytest.fixture(scope="session")
def llama():
    return tiny_llama().to(DEVICE)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama with a character tokenizer, saved as a local transformers folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder
