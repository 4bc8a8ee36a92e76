"""Loader: sharded safetensors checkpoints onto planned devices, with zero-copy disk offload and streaming.

Public API::

    load_model(path, device_map="auto", max_memory=None, dtype=None, quantization=None, offload_folder=None,
               *, progress=None, **workload) -> torch.nn.Module
    load_model_and_tokenizer(path, ...) -> (model, tokenizer)

``device_map`` is a strategy name ("auto", "balanced", "balanced_low_0", "sequential"), a dict in transformers'
hf_device_map format, or a :class:`planner.Plan` (obeyed exactly). The model carries ``hf_device_map`` and
``load_stats`` (:class:`LoadStats`); ``progress`` receives :class:`LoadProgress` updates.
"""
from loaders.errors import CheckpointError
from loaders.load import load_model, load_model_and_tokenizer
from loaders.progress import LoadProgress, LoadStats

__all__ = ["CheckpointError", "LoadProgress", "LoadStats", "load_model", "load_model_and_tokenizer"]
