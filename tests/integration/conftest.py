"""Integration set-up: one real local Ray for the whole session (2 CPUs, no dashboard),
and a random-weight tiny Qwen3 target saved with the shipped tokenizer, so collection
tests run against a real checkpoint directory without waiting for the trained one."""

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def ray_session(repo_root):
    import ray
    # Workers inherit the environment of the raylet started here: make the repo importable
    # in them whatever the working directory.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(repo_root),
                                                               os.environ.get("PYTHONPATH")])))
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def random_target(tmp_path_factory) -> str:
    """A 4-layer, width-64 Qwen3 with random weights + the tiny tokenizer, in one dir."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from dlite import tiny
    out = tmp_path_factory.mktemp("random_target")
    tok = tiny.load_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, intermediate_size=128))
    model.save_pretrained(out)
    for f in tiny.TOKENIZER_PATH.iterdir():
        shutil.copy(f, out / f.name)
    return str(out)
