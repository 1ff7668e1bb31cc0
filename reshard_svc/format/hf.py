"""Hugging Face folder conventions (names only, no torch): the sharded-weights index, the
files a model folder holds besides its weights, and which files are weights."""

from __future__ import annotations

from reshard_svc.errors import TargetExistsError
from reshard_svc.storage.base import Storage

__all__ = ["HF_INDEX", "MODEL_FILES", "check_model_folder", "model_weights"]

#: transformers' index of sharded safetensors weights.
HF_INDEX = "model.safetensors.index.json"
#: What a model folder holds besides its weights: config, generation config, tokenizer.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


def model_weights(storage: Storage) -> set[str]:
    """A model folder's weight files: ``*.safetensors`` and ``model.safetensors.index.json``
    (what an HF export replaces; config, tokenizer and README are not weights)."""
    return {n for n in storage.listdir() if n.endswith(".safetensors") or n == HF_INDEX}


def check_model_folder(storage: Storage, overwrite: bool) -> None:
    """An HF export may land in a model folder (its config, tokenizer and README stay),
    but replaces the weights there only with ``overwrite``."""
    if overwrite or storage.root_kind() != "folder":
        return
    weights = model_weights(storage)
    if weights:
        raise TargetExistsError(
            f"{storage.uri} holds model weights ({', '.join(sorted(weights)[:3])}); pass "
            "overwrite=True (--overwrite) to replace the weights and the index (its config, "
            "tokenizer and other files stay), or pick a new target"
        )
