"""The architecture sweep: every causal LM of the installed transformers, tiny and random, through
the three paths of the package.

For one architecture (a key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), :func:`check_architecture`
builds the tiny float32 CPU model of :mod:`.tiny_configs` (attention on SDPA where transformers has
it for the model, else its default attention), counts the SDPA calls of one eager forward of a
16-token prompt (one per attention layer) and runs:

- **compiled**: ``torch.compile(model, backend=vecinfer_backend.configure(quantize=False))``, the
  zero-config backend with the exact key transform and no quantization. It works when
  ``counters["vecinfer"]["sdpa_rewrites"]`` grew by the number of eager SDPA calls and the logits
  equal eager within ``atol = rtol = 1e-4`` (the float32 tolerance of
  :func:`vecinfer_compile.testing.check_model`). The backend's no-SDPA warning is a refusal.
- **simulate**: codebooks from :func:`vecinfer_compile.calibrate` (2 bits, 128 random token ids of
  the tiny vocabulary), then :func:`vecinfer_compile.simulation`: a residual window covering the
  prompt must give the eager logits (same tolerance); with no window the logits must change and
  attention must be quantized, once per eager SDPA call when every layer is full attention, in
  at least one call otherwise (a model mixing kinds quantizes the layers the cache codes; how
  many is noted).
- **cache+generate**: greedy ``generate()`` of 4 tokens through :class:`~vecinfer_compile.VecInferCache`
  (residual window 4, so the decode steps read codes) against the simulate path with the same
  codebooks and the cache's semantics (``full_precision_prefill=True``): every step's logits
  within the tolerance and the same tokens (a token that differs at a step whose logits agree, a
  near tie, is noted, not failed).

Each path ends ``works``, ``refused`` or ``crashed`` (:mod:`.outcomes`; a path or calibration
running longer than ``timeout`` seconds, default :data:`TIMEOUT`, crashes). Calibration failing
fails the simulate and cache paths alike. An architecture is ``skipped`` when its tiny model cannot
be built or does not run in transformers itself (eager, no package code involved).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from dataclasses import dataclass, field

import torch

from .outcomes import CRASHED, REFUSED, SKIPPED, WORKS, CheckFailed, Outcome, one_line, outcome_of, run_step, time_limit
from .tiny_configs import VOCAB, ConfigUnavailable, attention_kinds, tiny_config

PATHS = ("compiled", "simulate", "cache")
PROMPT_LEN, NEW_TOKENS, RESIDUAL, BITS = 16, 4, 4, 2
CALIBRATION_TOKENS = 128
TIMEOUT = 300.0  # seconds a path may take (a few architectures compile for minutes)
ATOL = RTOL = 1e-4  # testing.check_model's float32 tolerance
_SDPA = torch.nn.functional.scaled_dot_product_attention


@dataclass
class ArchitectureResult:
    """One row of the sweep. ``paths`` maps each of :data:`PATHS` to its :class:`Outcome` (empty
    when skipped); ``notes`` are facts worth a reader's eye (no SDPA in transformers, graph
    breaks, near ties); ``sdpa_calls`` and ``rewrites``: of the eager and compiled forwards."""

    name: str
    model_class: str
    config_class: str = ""
    kinds: list[str] = field(default_factory=list)
    paths: dict[str, Outcome] = field(default_factory=dict)
    skip_reason: str = ""
    notes: list[str] = field(default_factory=list)
    sdpa_calls: int | None = None
    rewrites: int | None = None

    @property
    def status(self) -> str:
        """skipped, else the worst of the paths: crashed, then refused, then skipped (a path
        transformers itself cannot run), then works."""
        if self.skip_reason:
            return SKIPPED
        found = {o.status for o in self.paths.values()}
        return next(s for s in (CRASHED, REFUSED, SKIPPED, WORKS) if s in found or s == WORKS)


def causal_lm_names() -> list[str]:
    """Every architecture of transformers' causal-LM mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# -- the model -------------------------------------------------------------------------------------
class _FixedIds:
    """A tokenizer stand-in for :func:`vecinfer_compile.calibrate`: any text is these token ids."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.ids}


def _token_ids(count: int, seed: int) -> torch.Tensor:
    """``[count]`` int64 ids in ``[3, VOCAB)``: clear of the tiny configs' pad/bos/eos (0, 1, 2)."""
    return torch.randint(3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def _model_class(name: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])


def _config_for(model_class, config):
    """``config``, or its sub-config that ``model_class`` takes (MusicgenForCausalLM: the decoder's)."""
    wanted = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(type(config), "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, wanted):
            return sub
    return config


def build_model(name: str, config):
    """``(model, note)``: the tiny model of ``config`` in float32 eval mode on SDPA, or on its
    default attention (``note`` says so) where transformers has no SDPA attention for it."""
    model_class = _model_class(name)
    config = _config_for(model_class, config)
    torch.manual_seed(0)
    try:  # on a copy: a refused attention implementation stays set on the config it was asked on
        model = model_class._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)
        note = ""
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        torch.manual_seed(0)
        model = model_class._from_config(config, dtype=torch.float32)
        note = f"no SDPA attention in transformers ({model.config._attn_implementation} attention)"
    return model.eval(), note


class _SdpaCounter(torch.overrides.TorchFunctionMode):
    """Counts ``F.scaled_dot_product_attention`` calls in its block (eager only)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits.float()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(((actual - expected).abs() <= ATOL + RTOL * expected.abs()).all())


def _check_close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.shape != expected.shape:
        raise CheckFailed(f"{what}: logits of shape {tuple(actual.shape)}, eager {tuple(expected.shape)}")
    if not _close(actual, expected):
        err = (actual - expected).abs().max().item()
        raise CheckFailed(f"{what} differs from eager by up to {err:.3g} (tolerance {ATOL:g} + {RTOL:g}|x|)")


# -- the three paths -------------------------------------------------------------------------------
class _BackendLog(logging.Handler):
    """Keeps the backend's warnings (its no-SDPA warning is a refusal)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_compiled(
    model, ids: torch.Tensor, eager: torch.Tensor, result: ArchitectureResult, seconds: float | None = None
) -> Outcome:
    """Zero-config backend, exact transform, no quantization: rewrites == SDPA calls, logits == eager."""
    from torch._dynamo.utils import counters

    from ..backend import vecinfer_backend

    torch._dynamo.reset()
    handler = _BackendLog()
    logger = logging.getLogger("vecinfer_compile.backend")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # kept here, not printed
    before_rewrites, before_graphs = counters["vecinfer"]["sdpa_rewrites"], counters["stats"]["unique_graphs"]

    def step():
        compiled = torch.compile(model, backend=vecinfer_backend.configure(quantize=False))
        actual = _logits(compiled, ids)
        result.rewrites = counters["vecinfer"]["sdpa_rewrites"] - before_rewrites
        graphs = counters["stats"]["unique_graphs"] - before_graphs
        if graphs > 1:
            result.notes.append(f"{graphs} compiled graphs (graph breaks)")
        _check_close("compiled", actual, eager)

    try:
        outcome = run_step(step, seconds)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        torch._dynamo.reset()
    no_sdpa = [m for m in handler.messages if "no F.scaled_dot_product_attention" in m]
    if outcome.status == WORKS and result.rewrites == 0 and no_sdpa:
        return Outcome(REFUSED, "backend warning: " + no_sdpa[0].split(". ")[0])  # its first sentence
    if outcome.status == WORKS and result.rewrites != result.sdpa_calls:
        return Outcome(
            CRASHED, f"CheckFailed: {result.rewrites} SDPA rewrite(s) for {result.sdpa_calls} eager SDPA call(s)"
        )
    return outcome


class _QuantizeCounter:
    """Counts each simulated layer's quantize_kv calls while installed (``with`` block)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        for sim in self._simulators():
            sim.quantize_kv = self._counting(sim.quantize_kv)
        return self

    def _simulators(self):
        """The layers' simulators that quantize (a layer kept in full precision has none)."""
        sims = (getattr(m, "vecinfer_simulator", None) for m in self.model.modules())
        return [sim for sim in sims if hasattr(sim, "quantize_kv")]

    def _counting(self, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return wrapped

    def __exit__(self, *exc):
        for sim in self._simulators():
            sim.__dict__.pop("quantize_kv", None)


def check_simulate(
    model, ids: torch.Tensor, eager: torch.Tensor, result: ArchitectureResult, codebooks, seconds: float | None = None
) -> Outcome:
    """A window over the whole prompt gives eager; with none, attention is quantized (once per
    SDPA call when every layer is full attention; for other kinds at least one call, the rest
    noted) and the logits change."""
    from ..simulate import simulation

    def step():
        with simulation(model, "vecinfer", bits=BITS, codebooks=codebooks, residual=len(ids)):
            _check_close("simulate with every key in the window", _logits(model, ids), eager)
        with simulation(model, "vecinfer", bits=BITS, codebooks=codebooks), _QuantizeCounter(model) as counter:
            quantized = _logits(model, ids)
        calls, expected = counter.calls, result.sdpa_calls
        if expected == 0 and calls > 0:  # eager-only attention: no SDPA call to count against
            result.notes.append(f"simulate quantizes {calls} attention calls (eager attention in transformers)")
            expected = calls
        if (calls != expected) if set(result.kinds) == {"full"} else not 0 < calls <= expected:
            raise CheckFailed(f"simulate quantized {calls} attention call(s) of {expected} eager SDPA call(s)")
        if calls < expected:
            result.notes.append(f"simulate quantizes {calls} of {expected} attention calls")
        if not torch.isfinite(quantized).all():
            raise CheckFailed("simulate logits are not finite")
        if _close(quantized, eager):
            raise CheckFailed("simulate logits equal eager: nothing was quantized")

    return run_step(step, seconds)


def _greedy(model, ids: torch.Tensor, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy new tokens of ``ids [T]`` and each step's ``[V]`` logits."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids)[None],
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    return out.sequences[0, len(ids) :].tolist(), [step[0].float() for step in out.logits]


def _generate_fails(model, ids: torch.Tensor) -> Outcome | None:
    """A skipped outcome when transformers' own greedy ``generate()`` fails on the tiny model
    (then no cache can be compared), else None."""
    try:
        _greedy(model, ids)
    except Exception as exc:
        return Outcome(SKIPPED, f"transformers' own generate() fails ({type(exc).__name__}: {one_line(exc)})")
    return None


def check_cache(model, ids: torch.Tensor, codebooks, notes: list[str], seconds: float | None = None) -> Outcome:
    """VecInferCache + greedy generate() against the simulate path with the cache's semantics."""
    from ..cache import VecInferCache
    from ..hf.compat import cache_kwargs
    from ..simulate import simulation

    def step():
        with simulation(
            model, "vecinfer", bits=BITS, codebooks=codebooks, residual=RESIDUAL, full_precision_prefill=True
        ):
            want_tokens, want_logits = _greedy(model, ids)
        cache = VecInferCache(model, codebooks, max_cache_len=len(ids) + NEW_TOKENS, residual=RESIDUAL)
        tokens, logits = _greedy(model, ids, **cache_kwargs(cache), disable_compile=True)
        for i, (a, b, la, lb) in enumerate(zip(tokens, want_tokens, logits, want_logits)):
            if not _close(la, lb):
                err = (la - lb).abs().max().item()
                raise CheckFailed(f"cache logits differ from simulate at new token {i} by up to {err:.3g}")
            if a != b:
                notes.append(f"cache and simulate tokens differ at new token {i} with equal logits (a near tie)")
                return
        if len(tokens) != len(want_tokens):
            raise CheckFailed(f"cache generated {len(tokens)} token(s), simulate {len(want_tokens)}")

    return run_step(step, seconds)


def calibrate_tiny(model, seed: int = 0, seconds: float | None = None):
    """``(codebooks, None)`` fitted by :func:`vecinfer_compile.calibrate` on random token ids, or
    ``(None, outcome)`` when calibration fails (the simulate and cache paths need it)."""
    from ..calibration import calibrate

    ids = _token_ids(CALIBRATION_TOKENS, seed).tolist()
    try:
        with time_limit(seconds):
            return calibrate(
                model,
                _FixedIds(ids),
                "random token ids",
                bits=BITS,
                max_tokens=CALIBRATION_TOKENS,
                seq_len=CALIBRATION_TOKENS // 2,
                iters=4,
                progress=False,
            ), None
    except Exception as exc:
        failed = outcome_of(exc)
        return None, Outcome(failed.status, "calibrate: " + failed.reason)


@contextlib.contextmanager
def _quiet():
    """transformers' and the package's own warnings off (the sweep records what matters)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    loggers = [logging.getLogger(n) for n in ("vecinfer_compile", "torch._dynamo", "torch._inductor")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        for logger, before in zip(loggers, levels):
            logger.setLevel(before)


def check_architecture(name: str, *, seed: int = 0, timeout: float | None = TIMEOUT) -> ArchitectureResult:
    """Build the tiny ``name`` model and run the three paths (see the module docstring); each
    path, and calibration, crashes with a :class:`PathTimeout` after ``timeout`` seconds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    result = ArchitectureResult(name, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(name, "?"))
    with _quiet():
        try:
            config = tiny_config(name)
            result.config_class, result.kinds = type(config).__name__, attention_kinds(config)
            model, note = build_model(name, config)
        except ConfigUnavailable as exc:
            result.skip_reason = str(exc)
            return result
        except Exception as exc:
            result.skip_reason = f"the tiny model does not build ({type(exc).__name__}: {one_line(exc)})"
            return result
        if note:
            result.notes.append(note)
        ids = _token_ids(PROMPT_LEN, seed + 1)
        try:
            with _SdpaCounter() as counter:
                eager = _logits(model, ids)
        except Exception as exc:
            result.skip_reason = f"the tiny model does not run in transformers ({type(exc).__name__}: {one_line(exc)})"
            return result
        result.sdpa_calls = counter.calls
        result.paths["compiled"] = check_compiled(model, ids, eager, result, timeout)
        codebooks, failed = calibrate_tiny(model, seed + 2, timeout)
        if failed is not None:
            result.paths["simulate"] = result.paths["cache"] = failed
            return result
        result.paths["simulate"] = check_simulate(model, ids, eager, result, codebooks, timeout)
        result.paths["cache"] = _generate_fails(model, ids) or check_cache(model, ids, codebooks, result.notes, timeout)
    return result


def sweep(
    names: list[str] | None = None, *, timeout: float | None = TIMEOUT, progress: bool = True
) -> list[ArchitectureResult]:
    """:func:`check_architecture` for each of ``names`` (default: every causal LM), in order."""
    from tqdm.auto import tqdm

    names = causal_lm_names() if names is None else names
    results = []
    bar = tqdm(names, desc="architectures", unit="arch", disable=not progress)
    for name in bar:
        bar.set_postfix_str(name)
        results.append(check_architecture(name, timeout=timeout))
    return results
