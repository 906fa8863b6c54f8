"""vecinfer_compile: a low-bit vector-quantized KV cache (VecInfer) for any Hugging Face model.

Public API (everything else is internal):

- :func:`calibrate`, :func:`load_codebooks`, :class:`VecInferCodebooks` — fit and store codebooks.
- :func:`enable_simulation` — eager quantize->dequantize attention (``attn_implementation="vecinfer"``).
"""

__version__ = "0.1.0"

from .codebooks import VecInferCodebooks, load_codebooks  # noqa: E402
from .presets import PRESETS, get_preset  # noqa: E402
from .calibrate import calibrate  # noqa: E402
from .simulate import disable_simulation, enable_simulation  # noqa: E402

__all__ = [
    "PRESETS",
    "VecInferCodebooks",
    "__version__",
    "calibrate",
    "disable_simulation",
    "enable_simulation",
    "get_preset",
    "load_codebooks",
]
