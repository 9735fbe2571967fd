"""Datasets, built-in tasks, prompt templates and the resumable prompt stream."""
from megatron_areal.data.jsonl import load_jsonl
from megatron_areal.data.prompt import DataError, Prompt
from megatron_areal.data.stream import PromptStream
from megatron_areal.data.tasks import BUILTIN_TASKS, load_datasets, load_task
from megatron_areal.data.template import encode_prompt

__all__ = ["BUILTIN_TASKS", "DataError", "Prompt", "PromptStream", "encode_prompt", "load_datasets", "load_jsonl",
           "load_task"]
