"""What the command line and the loaders agree on, importable without torch (``specla --help`` reads it)."""
from __future__ import annotations

LAYER_SKIP = "layer-skip"          # --drafter value that asks for the layer-skip drafter explicitly
MTP = "mtp"                        # --drafter value for the target checkpoint's own MTP head
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class ModelError(Exception):
    """A model cannot be loaded, or does not fit the target; the message is one line meant for the user."""
