"""Data loading: the bundled offline assets and the user's own files go through one path."""

from dpfit.data.bundled import (
    BUNDLED_MODELS,
    BundledAssetMissing,
    TextExample,
    bundled_model,
    hamlet_lines,
    minilm_path,
    rotten_tomatoes,
    smollm2_gguf,
    split_by_group,
)
from dpfit.data.text import (
    BundledSplits,
    ColumnError,
    DataError,
    DataFileNotFoundError,
    EmptyDataError,
    LabeledTexts,
    SingleClassError,
    UnseenLabelError,
    bundled_rotten_tomatoes,
    load_texts,
)

__all__ = [
    "BUNDLED_MODELS",
    "bundled_model",
    "BundledAssetMissing",
    "BundledSplits",
    "ColumnError",
    "DataError",
    "DataFileNotFoundError",
    "EmptyDataError",
    "LabeledTexts",
    "SingleClassError",
    "UnseenLabelError",
    "bundled_rotten_tomatoes",
    "load_texts",
    "TextExample",
    "hamlet_lines",
    "minilm_path",
    "rotten_tomatoes",
    "smollm2_gguf",
    "split_by_group",
]
