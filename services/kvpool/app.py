"""Building a replica's heavy state: the model, the pool and the engine."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from services.common.hashing import BlockHasher, say_which_hasher
from services.common.model_store import (
    ModelStoreError,
    is_converted,
    is_packaged,
    load_resolved,
    packaged_folder,
    readable_weights,
)
from services.common.policy import POOL_HIT_HALF_LIFE_S, make_policy
from services.kvpool.block_pool import BlockPool
from services.kvpool.calibrate import forward_costs
from services.kvpool.config import IMPLAUSIBLE, MAX_BLOCKS, KvPoolConfig
from services.kvpool.drafting import LadderChoice, choose_ladder, default_ladder
from services.kvpool.engine import Engine, ModelInfo, kv_shape, model_info
from services.kvpool.linear import Packing, pack_linears
from services.kvpool.metrics import KvMetrics
from services.kvpool.paged_cache import KvStore

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Replica:
    """What a running replica holds."""

    engine: Engine
    info: ModelInfo


def device_problem(device: str) -> str:
    """Why this process cannot use `device` ("" = it can). Checked before the model loads."""
    if not device.startswith("cuda"):
        return ""
    if not torch.cuda.is_available():
        return (f"this torch ({torch.__version__}) sees no CUDA device; a GPU needs a CUDA "
                "build of torch (the `cuda` image) and a visible GPU")
    _, _, index = device.partition(":")
    if index and int(index) >= torch.cuda.device_count():
        return f"only {torch.cuda.device_count()} CUDA device(s) are visible"
    return ""


def exact_matmuls() -> None:
    """float32 matrix products at full precision on CUDA: TF32 (NVIDIA_TF32_OVERRIDE, or any
    import that turns it on) keeps ~10 mantissa bits, and greedy tokens would then change with
    batching and caching where float32 promises they do not (the float32 logits of a half-
    precision model too). Half-precision products are left as torch has them: no exactness is
    promised there, and their speed is the point of the dtype."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def check_causal(model: Any, path: str, missing: Any = ()) -> None:
    """Refuses a folder that is not a decoder-only language model's: a sentence-transformers
    folder (BertModel) loaded as BertLMHeadModel, its head made up (`missing`: the weights
    the load initialised at random), and the replica said it was ready. Judged by the weights,
    not by the config's architecture name: a folder naming only its base model (LlamaModel)
    with the head tied to the embeddings loads whole."""
    cfg = model.config
    missing = sorted(missing)
    if getattr(cfg, "is_encoder_decoder", False) or missing:
        what = (f"{len(missing)} weights the model needs are not in it (e.g. {missing[0]})"
                if missing else "it is an encoder-decoder model")
        raise ModelStoreError(f"{path} is not a decoder-only language model's folder: {what}; "
                              "check TIERCACHE_KVPOOL_MODEL")


def check_attention(path: str) -> None:
    """Refuses, before the weights load, a folder whose architecture transformers runs
    without SDPA attention (Gemma 2, Bloom, Mamba, ...): the engine loads every model with
    attn_implementation="sdpa" and drives its paged cache through one 4-D boolean mask, which
    only SDPA takes as it is. transformers' own refusal ended the start in a paragraph naming
    neither the folder nor the setting, and advising a load argument a replica has no
    setting for. A folder that is no causal LM's is left to `from_pretrained` to name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        return
    cls = mapping[type(config)]
    if not getattr(cls, "_supports_sdpa", False):
        raise ModelStoreError(f"{path} holds a {cls.__name__}, which kvpool cannot serve: "
                              "transformers runs no SDPA attention for it, and the paged "
                              "cache needs SDPA; check TIERCACHE_KVPOOL_MODEL")


def check_finite(model: Any, path: str) -> None:
    """One forward of a few tokens, where the model was loaded (its CPU copy): logits that are
    not finite mean weights damaged in place (bit rot, a bad restore; safetensors checks no
    content), which loaded without a word and answered every request with garbage. Raises
    ModelStoreError (the packaged model is then converted again: `load_resolved`)."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    ids = torch.arange(1, 5).remainder(max(vocab, 1)).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    if not bool(torch.isfinite(logits).all()):
        raise ModelStoreError(f"the weights in {path} give non-finite logits: damaged in place? "
                              "check or replace the model folder (TIERCACHE_KVPOOL_MODEL)")


def load_model(cfg: KvPoolConfig) -> tuple[Any, str, Packing]:
    """Resolve and load the configured model on its device, its linear layers on the configured
    kernels; returns (model, model_id, what `pack_linears` did).

    Raises:
        ValueError: the configured device cannot be used here (before anything loads).
    """
    from transformers import AutoModelForCausalLM

    problem = device_problem(cfg.device)
    if problem:  # callers other than __main__ (benchmarks, tests) got torch's AssertionError
        raise ValueError(f"TIERCACHE_KVPOOL_DEVICE={cfg.device}: {problem}")
    if cfg.device.startswith("cuda"):
        exact_matmuls()
        log.info("CUDA: float32 matrix products at full precision (TF32 off)")

    def load(path: str) -> Any:
        log.info("loading model from %s on %s (%s)", path, cfg.device, cfg.dtype)
        # (The packaged model is converted again instead: load_resolved.)
        check_attention(path)
        with readable_weights(path, "TIERCACHE_KVPOOL_MODEL"):
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=_DTYPES[cfg.dtype], attn_implementation="sdpa",
                output_loading_info=True)
        check_causal(model, path, info.get("missing_keys") or ())
        check_finite(model, path)
        return model

    resolved, model = load_resolved(cfg.model, cfg.cache_dir or None, cfg.model_id or None,
                                    load, check_weights=True)
    model.to(cfg.device).eval()
    packing = pack_linears(model, cfg.linear_kernels)
    if packing.kernels == "onednn":
        log.info("linear layers: %d on oneDNN with packed weights "
                 "(TIERCACHE_KVPOOL_LINEAR_KERNELS)", packing.layers)
    elif packing.why_not != "configured":
        # Expected off the CPU (oneDNN is a CPU library): said, not warned, at every GPU start.
        log.log(logging.WARNING if cfg.device == "cpu" else logging.INFO,
                "linear layers stay on torch's kernels: %s", packing.why_not)
    return model, resolved.model_id, packing


def pool_blocks(cfg: KvPoolConfig, info: ModelInfo, dtype: torch.dtype) -> int:
    """Blocks in the pool: `num_blocks`, or as many as `kv_cache_bytes` holds.

    Raises:
        ValueError: `kv_cache_bytes` holds no block (it was rounded up to one block, and every
            request over one block's tokens was refused).
    """
    if cfg.num_blocks > 0:
        return cfg.num_blocks
    return _blocks_in_bytes(cfg, KvStore.block_bytes(info.num_layers, info.kv_heads,
                                                     info.head_dim, cfg.block_size, dtype))


def _blocks_in_bytes(cfg: KvPoolConfig, per: int) -> int:
    """Blocks of `per` bytes that `kv_cache_bytes` holds (ValueError: none, or too many)."""
    if cfg.kv_cache_bytes < per:
        raise ValueError(f"TIERCACHE_KVPOOL_KV_CACHE_BYTES: {cfg.kv_cache_bytes} bytes hold no KV "
                         f"block of this model ({per} bytes per {cfg.block_size}-token block)")
    blocks = cfg.kv_cache_bytes // per
    if blocks > MAX_BLOCKS:
        raise ValueError(f"TIERCACHE_KVPOOL_KV_CACHE_BYTES: {cfg.kv_cache_bytes} bytes make "
                         f"{blocks:,} KV blocks of this model, over the limit of {MAX_BLOCKS:,}")
    return blocks


def config_folder(cfg: KvPoolConfig) -> str | None:
    """The folder whose config.json the replica will load, where it can be read now, before
    anything is converted or loaded; None otherwise (the packaged model not converted yet:
    converting it is the load's work)."""
    if is_packaged(cfg.model):
        target = packaged_folder(cfg.cache_dir)  # as resolve_model will find it
        return str(target) if is_converted(target) else None
    folder = Path(cfg.model).expanduser()
    return str(folder) if (folder / "config.json").is_file() else None


def pool_problem(cfg: KvPoolConfig) -> str:
    """Why `kv_cache_bytes` sizes no pool of the configured model ("" = it does, or that cannot
    be told yet), from the model's config.json alone: `pool_blocks` refused it only after the
    weights had loaded (minutes for a large model from a network volume), as "the model could
    not be loaded", and named the variable where the flag was given."""
    if cfg.num_blocks > 0:
        return ""
    folder = config_folder(cfg)
    if folder is None:
        return ""
    try:
        from transformers import AutoConfig

        layers, kv_heads, head_dim = kv_shape(AutoConfig.from_pretrained(folder))
        per = KvStore.block_bytes(layers, kv_heads, head_dim, cfg.block_size, _DTYPES[cfg.dtype])
    except Exception:  # noqa: BLE001 - a config not read here is the load's to judge
        return ""
    try:
        _blocks_in_bytes(cfg, per)
    except ValueError as exc:
        return str(exc)
    return ""


def share(n: int, fraction: float) -> int:
    """Blocks of a pool of `n` that a share of it holds (at least one): `fraction` as the
    decimal it was written as. In binary floating point 100 x 0.29 is 28.999999999999996, and
    int() of it refused the share's last block."""
    return max(1, int(n * Fraction(repr(fraction))))


def _log_lengths(ladder: list[int], costs: Sequence[float], how: str, *args: object) -> None:
    """The start's line on the lengths chosen from forward costs (of 1..len(costs) tokens, in
    one token's); `how`, a %-format of `args`, says where the costs came from."""
    log.info("draft proposal lengths %s, from forwards of 1..%d tokens costing %s x one token's"
             + how, ",".join(map(str, ladder)), len(costs), " ".join(f"{c:.2f}" for c in costs),
             *args)


def draft_ladder(cfg: KvPoolConfig, model: Any,
                 threads_for: Callable[[int], int] | None = None) -> LadderChoice:
    """The drafts' proposal lengths: `cfg.draft_ladder`, or measured on this device."""
    fixed = cfg.fixed_ladder()
    if fixed is not None:
        return LadderChoice(fixed, "configured")
    given = cfg.given_costs()
    if given is not None:  # a timing taken elsewhere, on the same model and hardware
        ladder = choose_ladder(dict(enumerate(given, start=1)), cfg.max_draft_tokens)
        _log_lengths(ladder, given, " (given by TIERCACHE_KVPOOL_DRAFT_COSTS, not timed here)")
        return LadderChoice(ladder, "given", given)
    t0 = time.monotonic()

    def fall_back(why: str, costs: tuple[float, ...] = ()) -> LadderChoice:
        fallback = default_ladder(cfg.max_draft_tokens)
        log.warning("%s: draft proposal lengths %s (TIERCACHE_KVPOOL_DRAFT_LADDER fixes them)",
                    why, ",".join(map(str, fallback)))
        return LadderChoice(fallback, f"fixed: {why}", costs)

    try:
        costs = forward_costs(model, cfg.max_draft_tokens + 1, threads_for=threads_for)
    except Exception as e:  # noqa: BLE001 - any failure: the model still serves
        # A model the engine serves may still fail this plain-cache timing (a sliding window
        # shorter than its context, a cache without crop): drafts keep the fixed lengths.
        return fall_back(f"could not time draft forwards ({type(e).__name__}: {e})")
    base = costs[1]
    if not base > 0:  # a clock too coarse for one forward: no cost is relative to it
        return fall_back(f"draft forward timings unusable (one token's forward timed "
                         f"{base:g} s)")
    relative = tuple(round(costs[q] / base, 3) for q in sorted(costs))
    if min(costs[q] for q in costs if q > 1) < IMPLAUSIBLE * base:
        # More tokens for much less than one: the host was busy while timing (other replicas
        # starting beside this one), and the figures are noise.
        return fall_back(f"draft forward timings look disturbed (a forward of several tokens "
                         f"measured under {IMPLAUSIBLE:.0%} of one token's)", relative)
    # From the costs reported and logged (rounded), not the raw seconds: where the rounding
    # crossed the frontier's 2% bar, a replica given the value logged here chose other lengths.
    ladder = choose_ladder(dict(enumerate(relative, start=1)), cfg.max_draft_tokens)
    _log_lengths(ladder, relative, " %.1f ms (measured in %.1f s; TIERCACHE_KVPOOL_DRAFT_LADDER; "
                 "replicas of this model on this kind of host may skip the timing with "
                 "TIERCACHE_KVPOOL_DRAFT_COSTS=%s)", base * 1000, time.monotonic() - t0,
                 ",".join(map(str, relative)))
    return LadderChoice(ladder, "measured", relative)


def build_replica(cfg: KvPoolConfig, model: Any | None = None, model_id: str | None = None,
                  metrics: bool = True) -> Replica:
    """Load (or take) the model and start the engine over a fresh pool."""
    packing = None  # a model given is served on the kernels it has (the engine tells which)
    if model is None:
        model, model_id, packing = load_model(cfg)
    info = model_info(model, model_id or cfg.model_id or "model")
    if cfg.max_context > 0:
        info = dataclasses.replace(info, max_context=min(info.max_context, cfg.max_context))
    dtype = next(model.parameters()).dtype
    n = pool_blocks(cfg, info, dtype)
    if n * cfg.block_size < info.max_context:
        # Served all the same (a small pool is a choice), but a request past the pool's tokens
        # is refused every time: said at start, not first by a tenant's RESOURCE_EXHAUSTED.
        log.warning("the kv pool holds %d tokens (%d blocks of %d), less than the %d-token "
                    "context: a prompt and answer longer than that are refused "
                    "(TIERCACHE_KVPOOL_NUM_BLOCKS / _KV_CACHE_BYTES, or _MAX_CONTEXT)",
                    n * cfg.block_size, n, cfg.block_size, info.max_context)
    say_which_hasher()
    hasher = BlockHasher(info.model_id, cfg.block_size)
    # Events exist for the publisher; without a prefix index nobody would ever take them.
    pool = BlockPool(n, cfg.block_size, hasher,
                     # Shallow blocks' hits age: without, a base hot once stayed ahead of
                     # today's hot bases for good (LFU counts only ever grew).
                     make_policy(cfg.eviction_policy, cfg.shallow_tokens,
                                 half_life=POOL_HIT_HALF_LIFE_S),
                     record_events=bool(cfg.prefix_address),
                     max_pinned=share(n, cfg.max_pinned_fraction),
                     max_pinned_per_salt=share(n, cfg.max_pinned_per_tenant_fraction))
    # The working rows at their full size: max_batch_size rows of the whole context.
    rows_max = (KvStore.block_bytes(info.num_layers, info.kv_heads, info.head_dim,
                                    cfg.block_size, dtype) // cfg.block_size
                * cfg.max_batch_size * info.max_context)
    if cfg.preallocate_rows:
        # Logged before the allocation: a context too long for the device fails right after.
        log.info("allocating working rows for %d x %d tokens: %.0f MiB "
                 "(TIERCACHE_KVPOOL_PREALLOCATE_ROWS)", cfg.max_batch_size, info.max_context,
                 rows_max / 2**20)
    engine = Engine(model, info, pool, max_batch_size=cfg.max_batch_size,
                    max_prefill_chunk=cfg.max_prefill_chunk, max_waiting=cfg.max_waiting,
                    prefix_caching=cfg.prefix_caching, drafts=cfg.drafts,
                    max_draft_tokens=cfg.max_draft_tokens,
                    preallocate_rows=cfg.preallocate_rows,
                    metrics=KvMetrics() if metrics else None, threads=cfg.torch_threads,
                    one_thread_below=cfg.one_thread_below, batch_gate=cfg.draft_batch_gate,
                    learn_costs=cfg.draft_costs_learned, draft_branches=cfg.draft_branches,
                    prompt_lookup=cfg.prompt_lookup)
    if packing is not None:
        engine.packing = packing
    engine.start()
    if cfg.drafts:
        # On the engine thread, whose forwards the lengths are for (with its threads), before
        # anything is served: the timings need the device to themselves.
        engine.draft_ladder = engine.call(
            lambda: draft_ladder(cfg, model, engine.threads_for)).result()
    pool_b, rows_b = engine.store.nbytes()
    # Growing by doubling holds the old rows beside the new ones while copying.
    peak = rows_max * (1.0 if cfg.preallocate_rows else 1.5)
    log.info("kv pool: %d blocks of %d tokens (%.0f MiB), working rows %.0f MiB now, up to "
             "%.0f MiB at the %d-token context (TIERCACHE_KVPOOL_MAX_CONTEXT; %.0f MiB while "
             "growing)", n, cfg.block_size, pool_b / 2**20, rows_b / 2**20, rows_max / 2**20,
             info.max_context, peak / 2**20)
    return Replica(engine, info)
