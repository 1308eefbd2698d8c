"""``ServerArgs`` fix-ups for ``--attention-backend diffkv``: forced settings and refusals.

``ServerArgs.__post_init__`` runs in the process that parses the command line; scheduler
children receive the pickled, already fixed-up object. ``post_init_hook`` (an AROUND hook,
``plugin.HOOKS``) applies the forced settings before SGLang's own ``__post_init__`` resolves
the arguments (so its derived defaults see them), logging each forced setting once, with the
reason. After it the arguments are read-only (SGLang 0.5.17), so ``check_forced_settings`` only
verifies that every forced setting survived resolution, including the per-phase CUDA-graph
backends SGLang folds into ``cuda_graph_config``, and stops start-up with one line if not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from sglang_diffkv.config import DEFAULT_CUDA_GRAPH_MAX_BS, ConfigError, DiffKVConfig
from sglang_diffkv.sglang.ops import KERNELS_ENV, REFERENCE_MODES

logger = logging.getLogger("sglang_diffkv")

BACKEND_NAME = "diffkv"


# SGLang's name for a CUDA-graph phase that runs eagerly (cuda_graph_config.Backend.DISABLED)
GRAPHS_OFF = "disabled"
# decode graph backends the DiffKV decode supports: whole-step capture, or none
DECODE_GRAPH_BACKENDS = ("full", "disabled")


class DiffKVUnsupportedError(ValueError):
    """A server option that ``--attention-backend diffkv`` (stage 1) does not support."""


# (field, forced value, why): the one log line each forced setting gets.
FORCED_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("page_size", 1,
     "SGLang slots are per-token handles; DiffKV's own per-head pages sit behind them"),
    ("cuda_graph_backend_prefill", GRAPHS_OFF,
     "prefill CUDA graphs pad the token count, which the DiffKV extend does not handle"),
)


# Forced only on the torch reference path (SGLANG_DIFFKV_KERNELS=0), which synchronises
# with the host inside the forward; the Triton path captures decode graphs and runs under
# the overlap scheduler (pool.py: the scheduler's side waits on the forward's stream).
REFERENCE_FORCED_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("cuda_graph_backend_decode", GRAPHS_OFF,
     "SGLANG_DIFFKV_KERNELS=0 runs the torch reference, which cannot be graph-captured"),
    ("disable_overlap_schedule", True,
     "SGLANG_DIFFKV_KERNELS=0 runs the torch reference, which synchronises inside the "
     "forward"),
)


def forced_settings(environ: dict[str, str] | None = None
                    ) -> tuple[tuple[str, Any, str], ...]:
    """(field, forced value, why) for this process's compute path."""
    env = os.environ if environ is None else environ
    reference = env.get(KERNELS_ENV, "auto").strip().lower() in REFERENCE_MODES
    return FORCED_SETTINGS + (REFERENCE_FORCED_SETTINGS if reference else ())


def uses_diffkv(args: Any) -> bool:
    return BACKEND_NAME in (
        args.attention_backend,
        getattr(args, "prefill_attention_backend", None),
        getattr(args, "decode_attention_backend", None),
    )


def unsupported_reasons(args: Any) -> list[str]:
    """Every requested option diffkv refuses, as the message the user sees."""
    reasons = []
    for which in ("prefill_attention_backend", "decode_attention_backend"):
        value = getattr(args, which, None)
        if value is not None and value != BACKEND_NAME:
            reasons.append(
                f"--{which.replace('_', '-')} {value}: diffkv must run both prefill and decode "
                "(its decode reads the pages its prefill wrote); drop the option"
            )
    if args.attention_backend not in (None, BACKEND_NAME):
        reasons.append(
            f"--attention-backend {args.attention_backend} with a diffkv prefill/decode "
            "backend: use --attention-backend diffkv alone"
        )
    checks = (
        (getattr(args, "speculative_algorithm", None) is not None,
         "speculative decoding (--speculative-algorithm) is not supported"),
        (getattr(args, "enable_dp_attention", False),
         "DP attention (--enable-dp-attention) is not supported"),
        (getattr(args, "enable_hierarchical_cache", False),
         "hierarchical cache (--enable-hierarchical-cache) is not supported"),
        (getattr(args, "disaggregation_mode", "null") not in (None, "null"),
         "P/D disaggregation (--disaggregation-mode) is not supported"),
        (getattr(args, "enable_mixed_chunk", False),
         "--enable-mixed-chunk is not supported: a mixed batch's extend and decode rows would "
         "need per-mode metadata the DiffKV backend does not build (chunked prefill itself "
         "is supported: its chunks run as extend steps of their own)"),
        (getattr(args, "pp_size", 1) > 1,
         "pipeline parallelism (--pp-size > 1) is not supported in stage 1"),
        (getattr(args, "cuda_graph_backend_decode", None) not in (None, *DECODE_GRAPH_BACKENDS),
         f"--cuda-graph-backend-decode {getattr(args, 'cuda_graph_backend_decode', None)}: "
         f"the DiffKV decode supports {' or '.join(DECODE_GRAPH_BACKENDS)}"),
        (getattr(args, "kv_cache_dtype", "auto") not in ("auto", "bf16", "bfloat16"),
         f"--kv-cache-dtype {getattr(args, 'kv_cache_dtype', None)}: the DiffKV config sets the "
         "KV precision (SGLANG_DIFFKV_CONFIG); leave --kv-cache-dtype at auto"),
    )
    reasons += [f"--attention-backend diffkv: {msg}" for bad, msg in checks if bad]
    return reasons


def check_supported(args: Any) -> None:
    reasons = unsupported_reasons(args)
    if reasons:
        raise DiffKVUnsupportedError("; ".join(reasons))


def forced_setting_lines(args: Any) -> list[str]:
    """One line per forced setting, naming the user's value when it is overridden."""
    lines = []
    for name, value, why in forced_settings():
        before = getattr(args, name, None)
        was = "" if before in (None, value) else f" (was {before})"
        lines.append(f"diffkv: forcing {name}={value}{was}: {why}")
    return lines


def apply_forced_settings(args: Any) -> None:
    """Set the forced settings before SGLang resolves the arguments (and log each once)."""
    # The launching process has not configured logging yet when ServerArgs is built, so an
    # override of the user's own value is a warning (always shown); the scheduler repeats
    # every line at INFO in the server log (runner.init_pools).
    for line in forced_setting_lines(args):
        logger.log(logging.WARNING if "(was " in line else logging.INFO, line)
    for name, value, _ in forced_settings():
        setattr(args, name, value)


RADIX_BACKEND = "diffkv"  # (sglang_diffkv.sglang.radix.BACKEND_NAME)


def apply_radix_setting(args: Any) -> None:
    """The radix cache: DiffKV's own tree (``--radix-cache-backend diffkv``, registered by
    the plugin) unless the user turned the radix cache off, which gives SGLang's chunk cache
    (no prefix sharing). One log line says which."""
    if args.disable_radix_cache:
        logger.info("diffkv: radix cache off (--disable-radix-cache): no prefix sharing, "
                    "every prompt is prefilled from its first token")
        return
    if getattr(args, "tp_size", 1) > 1:
        args.disable_radix_cache = True
        logger.warning("diffkv: forcing disable_radix_cache=True: with --tp-size > 1 every "
                       "rank's tree would have to agree on which prompt exports fit their "
                       "pages (not built); prompts are prefilled from their first token")
        return
    for flag in ("enable_lmcache", "enable_flexkv"):
        if getattr(args, flag, False):
            raise DiffKVUnsupportedError(
                f"--attention-backend diffkv: --{flag.replace('_', '-')}: diffkv's radix tree "
                "holds compressed pages no external KV store can hold; drop the option (or "
                "add --disable-radix-cache)")
    backend = getattr(args, "radix_cache_backend", None)
    if backend not in (None, RADIX_BACKEND):
        raise DiffKVUnsupportedError(
            f"--attention-backend diffkv: --radix-cache-backend {backend}: diffkv shares "
            f"prefixes through its own tree ({RADIX_BACKEND}); drop the option")
    args.radix_cache_backend = RADIX_BACKEND
    logger.info("diffkv: radix_cache_backend=%s: prompts enter SGLang's radix tree as their "
                "compressed pages (shared read-only, cut at multiples of "
                "SGLANG_DIFFKV_RADIX_CUT tokens); --disable-radix-cache turns it off",
                RADIX_BACKEND)


def apply_defaults(args: Any) -> None:
    """Defaults diffkv changes where the user left SGLang's (before its __post_init__)."""
    explicit = args.cuda_graph_config
    explicit = explicit.to_dict() if hasattr(explicit, "to_dict") else (explicit or {})
    user_sized = (args.cuda_graph_max_bs_decode is not None
                  or args.cuda_graph_bs_decode is not None
                  or any(k in (explicit.get("decode") or {}) for k in ("max_bs", "bs")))
    if not user_sized:
        args.cuda_graph_max_bs_decode = DEFAULT_CUDA_GRAPH_MAX_BS
        logger.info("diffkv: --cuda-graph-max-bs-decode defaults to %d (decode batches up to "
                    "it replay CUDA graphs; larger ones run eagerly)", DEFAULT_CUDA_GRAPH_MAX_BS)


def check_forced_settings(args: Any) -> None:
    """After SGLang's ``__post_init__`` the arguments are resolved and read-only: every forced
    setting must have survived, and so must the resolved per-phase CUDA-graph backends (an
    explicit ``--cuda-graph-config`` JSON outranks the per-phase flags we set)."""
    config = getattr(args, "cuda_graph_config", None)
    for name, value, why in forced_settings():
        if name.startswith("cuda_graph_backend_") and hasattr(config, "prefill"):
            phase = name.rsplit("_", 1)[1]
            got, where = getattr(config, phase).backend, f"cuda_graph_config {phase} backend"
        else:
            got, where = getattr(args, name), f"--{name.replace('_', '-')}"
        if got != value:
            raise DiffKVUnsupportedError(
                f"--attention-backend diffkv: {where} resolved to {got!r}; diffkv needs "
                f"{value!r} ({why})"
            )
    if config is not None and hasattr(config, "decode") and (
            config.decode.backend not in DECODE_GRAPH_BACKENDS):
        raise DiffKVUnsupportedError(
            f"--attention-backend diffkv: cuda_graph_config decode backend "
            f"{config.decode.backend!r}: the DiffKV decode supports "
            f"{' or '.join(DECODE_GRAPH_BACKENDS)}")


def load_config_for_startup() -> DiffKVConfig:
    """Validate SGLANG_DIFFKV_CONFIG in the launching process, so a bad value fails before
    any scheduler starts."""
    try:
        config = DiffKVConfig.from_env()
    except ConfigError as e:
        raise DiffKVUnsupportedError(f"--attention-backend diffkv: {e}") from e
    logger.info(
        "diffkv: config %r (high %s, low %s, alpha_h %s, alpha_l %s); choose another with "
        "SGLANG_DIFFKV_CONFIG=<preset | inline JSON | path.json>",
        config.name, config.high.name, config.low.name, config.alpha_h, config.alpha_l,
    )
    if config.bench_note is not None:
        # a warning: a benchmark-mode server must not be mistaken for a real one
        logger.warning("diffkv: config %r: %s", config.name, config.bench_note)
    return config


def check_model(args: Any) -> None:
    """Refusals that need the model config (skipped for SGLang's 'dummy' model path)."""
    if str(args.model_path).lower() in ("none", "dummy"):
        return
    if args.use_mla_backend():
        raise DiffKVUnsupportedError(
            "--attention-backend diffkv: MLA models (DeepSeek-V2/V3 style latent attention) "
            "are not supported; DiffKV compresses per-KV-head keys and values"
        )


def post_init_hook(original: Callable[[Any], None], self: Any) -> None:
    """AROUND ``ServerArgs.__post_init__``: other backends run SGLang's own code alone."""
    if not uses_diffkv(self):
        original(self)
        return
    check_supported(self)
    load_config_for_startup()
    apply_forced_settings(self)
    apply_radix_setting(self)
    apply_defaults(self)
    original(self)
    check_supported(self)
    check_forced_settings(self)
    check_model(self)
