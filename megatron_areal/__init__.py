"""megatron-areal: fully asynchronous RL for language-model reasoning on Megatron-core."""

__version__ = "0.1.0"
