"""Loading models and texts for the command line and the evaluations, with clear errors.

The package ships a tiny model (``data/tiny``, 5.2 M parameters, Llama architecture) and a
~100 KB public-domain text (``data/sample_public_domain.txt``) so that ``vecinfer demo`` runs
offline. Every function also takes any local path, so the same code runs on your own models.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _data_dir() -> Path:
    return Path(str(resources.files("vecinfer_compile") / "data"))


def default_model_dir() -> Path:
    """The embedded tiny model (a Hugging Face directory inside the package)."""
    return _data_dir() / "tiny"


def default_text_path() -> Path:
    """The embedded public-domain text (it is in the tiny model's training corpus)."""
    return _data_dir() / "sample_public_domain.txt"


def default_codebooks_dir() -> Path:
    """Codebooks for the embedded tiny model, calibrated on the second half of the embedded
    text (see ``data/tiny/DATA_CARD.md``); ``vecinfer demo`` uses them unless --recalibrate."""
    return _data_dir() / "tiny_codebooks"


def check_model_dir(path: str | Path) -> Path:
    """Raise FileNotFoundError naming the problem unless ``path`` is a HF model directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {path} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json: not a Hugging Face model directory")
    return path


def check_file(path: str | Path, what: str = "text file") -> Path:
    """Raise FileNotFoundError unless ``path`` is an existing regular file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is not a file")
    return path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None: CUDA when available, else CPU. A CUDA device on a machine or a torch build
    without CUDA is a ValueError naming the fix."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build that sees no GPU"
        raise ValueError(
            f"device {device!r} asked for, but this torch ({torch.__version__}) is {build}: "
            "use device 'cpu' (--device cpu), or install a CUDA build of torch on a GPU machine"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s): "
            f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return dev


def load_tokenizer(model_dir: str | Path | None = None):
    """The tokenizer of a local Hugging Face directory (default: the embedded tiny model), checked
    to turn text into tokens (a folder without its vocabulary files can give an empty one): the
    command line tokenizes and checks its texts with it before it loads the model."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .api_arguments import check_tokenizer

    model_dir = check_model_dir(default_model_dir() if model_dir is None else model_dir)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load the tokenizer of {model_dir} (tokenizer.json / tokenizer_config.json "
            f"missing or unreadable): copy the model's tokenizer files into it ({_one_line(exc)})"
        ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        check_tokenizer(tokenizer, "The quick brown fox jumps over the lazy dog.", "load_model")
    except (TypeError, ValueError):
        raise
    except Exception as exc:  # tokenizers' own errors: a vocabulary that does not fit the tokenizer's settings
        raise ValueError(
            f"the tokenizer of {model_dir} cannot tokenize text ({_one_line(exc)}): its tokenizer "
            "files do not belong together; copy the model's own tokenizer files into it"
        ) from exc
    return tokenizer


def load_model(
    model_dir: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = "auto",
    attn_implementation: str = "sdpa",
    tokenizer=None,
):
    """Load ``(model, tokenizer)`` from a local Hugging Face directory (default: the embedded
    tiny model), in eval mode on ``device``; ``tokenizer``: one :func:`load_tokenizer` gave already.
    Clear errors for a missing or wrong directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = check_model_dir(default_model_dir() if model_dir is None else model_dir)
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no weight-loading chatter in command output
    try:
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch_dtype, attn_implementation=attn_implementation
            )
        except OSError as exc:
            raise FileNotFoundError(f"cannot load a model from {model_dir}: {_one_line(exc)}") from exc
        except Exception as exc:  # safetensors' SafetensorError and friends: a damaged weight file
            if "safetensor" not in type(exc).__name__.lower() and "deserializ" not in str(exc).lower():
                raise
            raise ValueError(
                f"cannot read the weights in {model_dir} ({_one_line(exc)}): the .safetensors file is "
                "truncated or damaged; copy or download it again"
            ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model.to(dev).eval()
    return model, tokenizer


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def load_text(path: str | Path | None = None) -> str:
    r"""Read a UTF-8 text file (default: the embedded sample) with its line ends read as ``\n``
    (Windows ``\r\n`` and old Mac ``\r`` too, as Python's text mode reads them: a file's line
    ends must not change its tokens); clear error if it is missing, empty or not UTF-8 (a binary
    or Latin-1 file used to be scored with its bad bytes replaced)."""
    path = check_file(default_text_path() if path is None else path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"text file {path} is not UTF-8 (byte {exc.start}: 0x{data[exc.start]:02x}); convert it, e.g. "
            f"`iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8.txt`, or pass a text file"
        ) from None
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return text


def split_text(text: str, fraction: float = 0.5) -> tuple[str, str]:
    """Cut ``text`` at the first line break after ``fraction`` of its length: ``(head, tail)``.
    The demo evaluates on the head and calibrates on the tail, so the two never overlap."""
    at = text.find("\n", int(len(text) * fraction))
    if at < 0:
        at = int(len(text) * fraction)
    return text[: at + 1], text[at + 1 :]


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids ``[N]`` (int64) of ``text`` with no special tokens added (no BOS)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
