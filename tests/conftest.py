import os

# One thread per process: several trainer ranks and servers share two cores in CI.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    from megatron_areal.model.assets import tiny_model_path
    return tiny_model_path("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    from megatron_areal.model.assets import tiny_model_path
    return tiny_model_path("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from megatron_areal.model.assets import tiny_model_path
    return tiny_model_path("qwen3")


@pytest.fixture(scope="session")
def smollm2():
    from megatron_areal.model.assets import smollm2_path
    return smollm2_path()
