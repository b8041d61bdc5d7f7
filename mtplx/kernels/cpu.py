"""The CPU decode path's C++ kernels (AVX2, FMA, F16C; AVX-512 products where the CPU has it):
group-quantized and bfloat16-weight matrix products (``cpu_quant.cpp``), a decoder layer's small
steps (``cpu_fused.cpp``: residual add + RMSNorm, q/k norms + RoPE + KV write, one row's paged
attention, SiLU * up) and the whole layer as one call (``layer``). Compiled once per machine by
``torch.utils.cpp_extension`` (g++ and ninja; about a minute, cached under
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); where they cannot be built
(no AVX2, no compiler, or ``MTPLX_CPU_KERNELS=0``) the PyTorch ops they replace run instead.

Why: on a 135M model a decode step's small PyTorch ops cost more in dispatch than in arithmetic
(about half of an AR step on this project's 2-core AVX2 EPYC), and PyTorch's packed int4
kernel (``aten._weight_int4pack_mm_for_cpu``) takes bf16 activations only; with these kernels
AR and MTP decode 1.6x faster there (docs/performance.md, "The CPU decode path through C++
kernels").

Quantized layout (``pack``): int4 as two nibbles per byte in GGUF's order (byte ``16 c + j`` of
a row holds inputs ``32 c + j`` low and ``32 c + 16 + j`` high), int8 one per byte; a float16
scale and offset per group of ``group_size`` inputs (a multiple of 32), both [out, groups]
(offsets [out, 0] for int8 weights whose offsets are all 0, GGUF's Q8_0: none stored or read):
``w = u * scale + zero`` with ``u`` the stored integer (int4: in [0, 15]). Activations are
multiplied as float32, or (``activation_bits``) rounded to int16 (the default: each 32 inputs
of a row on one scale for AVX-512 VNNI products, the whole row on one scale for AVX2's) or int8
(llama.cpp's rounding, each 32 inputs on one scale) and multiplied in integers; the offsets
always see the float sums of the activations. Every kernel computes a token row the same way
whatever else is in the batch, so a verify of 1 + D tokens gives each the numbers an AR step
gives it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no build_guard
    fcntl = None

log = logging.getLogger("mtplx")

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_quant.cpp", "cpu_fused.cpp")]
ENV_SWITCH = "MTPLX_CPU_KERNELS"  # "0": PyTorch's ops instead
ACTIVATIONS_SWITCH = "MTPLX_CPU_ACTIVATIONS"  # "float32" / "int16" / "int8" for every quantized layer
WIDTH_SWITCH = "MTPLX_CPU_VECTOR_WIDTH"  # "256": the AVX2 products on an AVX-512 CPU (A/B runs)
FLOAT16_MAX = 65504.0
# A build directory's lock older than this was left by a killed process (a build takes about a
# minute here; a check of a built module, well under a second)
STALE_LOCK_S = 600.0
# ... and, where no other mtplx process is loading the module (``build_guard``), one older than
# this with no build running in its directory (``building_in``)
IDLE_LOCK_S = 10.0
GUARD_FILE = "mtplx.flock"  # build_guard's file in the build directory


def cpu_supported() -> bool:
    """Whether this CPU has AVX2 (PyTorch's own dispatch check) and a C++ compiler and ninja are
    on PATH."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    return shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built here (logged once)."""
    if not cpu_supported():
        if os.environ.get(ENV_SWITCH, "1") != "0" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            log.warning("no C++ compiler or ninja on PATH: the CPU runs PyTorch's ops (slower); "
                        "install g++ for the CPU kernels")
        return None
    from torch.utils import cpp_extension

    try:
        build_directory = getattr(cpp_extension, "_get_build_directory", None)
        directory = Path(build_directory("mtplx_cpu", verbose=False)) if build_directory is not None else None
        with build_guard(directory) as alone:
            if directory is not None:
                clear_stale_lock(directory / "lock", alone=alone)
            module = cpp_extension.load(
                name="mtplx_cpu", sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # no working toolchain: fall back
        log.warning("the CPU kernels could not be built (%s); using PyTorch's ops", exc)
        return None
    width = os.environ.get(WIDTH_SWITCH, "")
    if width not in ("", "256", "512"):
        raise ValueError(f"{WIDTH_SWITCH}={width!r}: expected 256 (AVX2) or 512 (AVX-512)")
    if width:
        module.quant_isa(int(width))
    return module


@contextlib.contextmanager
def build_guard(directory: Path | None):
    """Take turns with other mtplx processes over the build directory: an exclusive ``flock`` on
    ``directory / GUARD_FILE`` for as long as this process checks and loads the module (the
    kernel drops it when its holder dies, whoever and wherever the holder is). Yields whether it
    is held: then no other mtplx process is loading the module, and a PyTorch lock found there
    was left behind (``clear_stale_lock``). False where it cannot be taken (no ``fcntl``, a
    directory that cannot hold the file)."""
    fd = None
    if directory is not None and fcntl is not None:
        try:
            fd = os.open(directory / GUARD_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process's build of the CPU kernels (%s)", directory)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # (releases the flock)


def clear_stale_lock(lock: Path, stale_s: float = STALE_LOCK_S, poll_s: float = 0.5, alone: bool = False,
                     idle_s: float = IDLE_LOCK_S) -> None:
    """Wait while another process holds the build directory's lock (``cpp_extension.load`` takes
    it even to find the module built), saying so once; remove it where it was left behind: a
    process killed while it held it (a server stopped mid-start) leaves it, and PyTorch's own
    wait for it has no end. Left behind: older than ``stale_s``; or, where this process holds
    the directory's ``build_guard`` (``alone``: no other mtplx process is loading the module),
    older than ``idle_s`` with no process building there (``building_in``: a killed holder's
    ninja may still be compiling, and is waited for). Before the guard every such lock held the
    next start for the whole ``stale_s``, 10 minutes."""
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s or (alone and age > idle_s and building_in(lock.parent) is not True):
            why = f"over {stale_s:.0f} s old" if age > stale_s else "no other mtplx process loading, none building"
            log.warning("removing %s, a lock %.0f s old (%s): a process that built or checked the CPU kernels was "
                        "stopped while it held it", lock, age, why)
            lock.unlink(missing_ok=True)
            return
        if not said:
            log.info("waiting for another process's build of the CPU kernels (%s)", lock)
            said = True
        time.sleep(poll_s)


def building_in(directory: Path) -> bool | None:
    """Whether a process this one can see works in ``directory`` (cpp_extension runs ninja
    there, and ninja the compiler), by each process's /proc cwd, compared as a file (device and
    inode: any path to it, bind mounts included); None where /proc cannot be read (not Linux).
    Other users' processes and other hosts' cannot be seen."""
    try:
        target = os.stat(directory)
        entries = [e.path for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    seen = False
    for entry in entries:
        try:
            cwd = os.stat(os.path.join(entry, "cwd"))
        except OSError:  # gone, or another user's
            continue
        seen = True
        if (cwd.st_dev, cwd.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False if seen else None


def vector_width(force: int = 0) -> int:
    """The vector width of the quantized products: 512 where the CPU has AVX-512 (F, BW, VL, DQ;
    detected when the module loads; int16 activations take VNNI there where it has that too),
    else 256 (AVX2). ``force`` (256 or
    512) switches for the whole process, as ``MTPLX_CPU_VECTOR_WIDTH`` does at load; 512 is
    refused where the CPU lacks it."""
    return extension().quant_isa(force)


def available() -> bool:
    return extension() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether the fused CPU ops take this activation: float32 on the CPU, under no_grad or
    inference_mode (they have no backward; forge trains through PyTorch's ops)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled() and available()


# --- quantized matrix products ------------------------------------------------------------------

def activation_bits() -> int:
    """The bits a quantized layer's activations are multiplied at: 16 by default where the
    kernels are built (rounded to int16 with one scale, max |a| / 32767, and multiplied in
    integers: each 32 inputs of a row on AVX-512 VNNI where the CPU has it, else each row on one
    scale with AVX2's vpmaddwd, which saves a multiply per token row and 32 weights;
    int4 and int8 weights in groups of 32 or of a multiple of 64 with a multiple of 64 inputs,
    the others stay float32), except on AVX-512 CPUs without VNNI, which keep their 512-bit
    float32 products (the 256-bit int16 tile was not measured there), and 32 (float32) where the
    kernels are not built. ``MTPLX_CPU_ACTIVATIONS`` chooses: ``float32``,
    ``int16`` or ``int8`` (llama.cpp's rounding, about 10% faster than float32 on the default
    model but its greedy output leaves the float32 model's within a few dozen tokens, 0 of 8
    prompts identical for 64 tokens; int16 per 32 inputs kept 8 of 8, int16 per row 7 of 8:
    docs/performance.md, sessions 32 and 35)."""
    mode = os.environ.get(ACTIVATIONS_SWITCH, "")
    if mode not in ("", "float32", "int16", "int8"):
        raise ValueError(f"{ACTIVATIONS_SWITCH}={mode!r}: expected float32, int16 or int8")
    if mode in ("float32", "int8"):
        return 32 if mode == "float32" else 8
    if mode == "int16":
        return 16
    return 16 if available() and (extension().quant_has_vnni() or vector_width() == 256) else 32


def fits(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> bool:
    """Whether ``pack``'s float16 scales and offsets hold these without overflowing."""
    if not scale.numel():
        return True
    stored = zero - 8 * scale if bits == 4 else zero  # the offset ``pack`` stores
    return max(float(scale.abs().max()), float(stored.abs().max())) < FLOAT16_MAX


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int):
    """(weights, scale, zero) for ``matmul`` from the portable form: q [out, in] int8 (int4 values
    in [-8, 7]), ``w = q * scale + zero`` per group; for int4 the stored nibble is q + 8, so the
    offset becomes ``zero - 8 * scale``. int8 weights whose offsets are all 0 (GGUF's Q8_0, a
    symmetric rounding) get zero [out, 0]: the kernels then neither read offsets nor sum the
    activations' groups for them. An odd number of rows gets one more row of zeros (the kernel
    takes rows in pairs): the caller cuts its output."""
    out, k = q.shape
    if k % 32 or group_size % 32:
        raise ValueError(f"in_features {k} and group_size {group_size} must be multiples of 32")
    scale, zero = scale.float(), zero.float()
    if out % 2:
        q = torch.cat((q, q.new_zeros(1, k)))
        scale = torch.cat((scale, scale.new_ones(1, scale.shape[1])))
        zero = torch.cat((zero, zero.new_zeros(1, zero.shape[1])))
    if bits == 4:
        zero = zero - 8 * scale
        u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(q.shape[0], k // 32, 2, 16)
        words = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(q.shape[0], k // 2).contiguous()
    else:
        words = q.to(torch.int8).contiguous()
    zero = zero.half()
    if bits == 8 and not bool(zero.any()):
        zero = zero[:, :0]
    return words, scale.half().contiguous(), zero.contiguous()


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored integers u [out, in] int32 (int4: in [0, 15]) back from ``pack``'s layout."""
    if bits == 8:
        return words.to(torch.int32)
    out = words.shape[0]
    w = words.reshape(out, -1, 16).to(torch.int32)
    return torch.stack((w & 15, w >> 4), dim=2).reshape(out, -1)


# up to this many rows the kernel; more (prefill): dequantize, one float32 matmul (float32
# activations; int8 ones always take the kernel). 16 before session 19, when a batch's verify of
# 24 rows dequantized every weight: benchmarks/results/cpu_s19_products.txt (two threads, the
# default model's projections at 8-96 rows; the kernel faster at every count up to 48 but gate/up
# at 24 and 32 rows) and cpu_s19_batch_attention.txt (engine.step over 8 rows at depth 2: 2.03x,
# with the attention's change)
SMALL_ROWS = 48


def matmul(a: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           group_size: int, bits: int, activations: int = 32) -> torch.Tensor:
    """a [M, in] float32 @ the packed weight [out, in]^T -> [M, out] float32, the activations
    multiplied at ``activations`` bits (32, 16 or 8: ``activation_bits``; 16 runs as 32 where
    int16 does not apply). More than ``SMALL_ROWS`` rows (a prompt's forward) take the
    dequantized weight through one float32 matrix product (BLAS, float32 activations unless 8),
    about twice the kernel's rate there; a row's result then depends on the forward it is in
    through that switch and BLAS's summation order, as in the float model."""
    if a.shape[0] > SMALL_ROWS and activations != 8:
        return a @ dequantize(words, scale, zero, group_size, bits).T
    return extension().quant_matmul(a, words, scale, zero, group_size, bits, activations)


def dequantize(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
               bits: int) -> torch.Tensor:
    """The float32 weight [out, in] (padding row included) the packed layout stands for."""
    return extension().quant_dequantize(words, scale, zero, group_size, bits)


def bf16_matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [M, in] float32 @ weight [out, in] bfloat16 ^T -> [M, out] float32: the weight widened
    exactly (a bf16 value is its float32's top half), products and sums in float32, each row on
    its own (in a multiple of 16). For an MTP head shipped in bf16: its float32 copy's numbers up
    to summation order, at half the bytes."""
    return extension().bf16_matmul(a, weight)


def dense_matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``bf16_matmul`` for a weight [out, in] in bfloat16, float16 or float32 (contiguous, in a
    multiple of 16): each weight widened exactly to float32, products and sums in float32, each
    row on its own whatever the number of rows. Bound by reading the weight: on this project's
    2-core CPU a 49,152 x 576 float32 matrix at 1 / 2 / 48 rows takes 3.3 / 3.8 / 13.8 ms where
    ``F.linear`` takes 8.4 / 19.3 / 35.1 (benchmarks/cpu_dense.py, cpu_s20_dense.txt)."""
    return extension().dense_matmul(a, weight)


# --- a layer's small steps ----------------------------------------------------------------------

def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + delta, rmsnorm(x + delta) * weight); delta None: (x, norm(x))."""
    return tuple(extension().add_rms_norm(x, delta, weight, eps))


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A fused qkv projection's output [..., (heads + 2 kv_heads) head_dim] -> q [tokens, heads,
    head_dim] after its norm and RoPE; k (norm, RoPE) and v written to the pools at ``slots``
    (float32 pools as computed, float16 ones rounded to nearest, as ``.half()`` rounds)."""
    return extension().rope_write(qkv, cos, sin, slots, k_pool, v_pool, heads, kv_heads, head_dim,
                                  q_norm, k_norm, eps)


def take_half_overflow() -> bool:
    """Whether a finite key or value of magnitude 65,520 or more became inf in a float16 pool
    (``rope_write``, ``layer``) since the last call, which clears it; False where the kernels
    were never loaded (nothing wrote through them)."""
    if extension.cache_info().currsize == 0:
        return False
    module = extension()
    return module is not None and module.take_half_overflow()


def pools_usable(pool: torch.Tensor) -> bool:
    """Whether ``rope_write``, ``row_attention`` and ``layer`` take KV pools like this one:
    float32 or float16, contiguous."""
    return pool.dtype in (torch.float32, torch.float16) and pool.is_contiguous()


def row_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                  positions: torch.Tensor, key_start: int, scale: float) -> torch.Tensor:
    """One row's queries q [Q, heads, head_dim], query i attending keys key_start..positions[i]
    of its paged cache -> [Q, heads * head_dim]; float32 or float16 pools (each element widened
    exactly as it is read: the numbers of attending over the pools' ``.float()``)."""
    return extension().row_attention(q, k_pool, v_pool, block_table, positions, key_start, scale)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return extension().silu_mul(gate_up)


# --- a whole decoder layer ----------------------------------------------------------------------

def projection(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, bits: int,
               out_features: int, activations: int = 32):
    """A weight as the C++ layer holds it: ``pack``'s layout (bits 4 or 8; ``out_features`` cuts
    the padding row; ``activations``: 32 or 16, as ``matmul``), or (bits 16 or 32) a dense weight
    [out, in] for ``dense_matmul``, scale and zero empty."""
    return extension().Projection(words, scale, zero, group_size, bits, out_features, activations)


def layer(ln1: torch.Tensor, ln2: torch.Tensor, eps: float, qkv, o, gate_up, down, heads: int, kv_heads: int,
          head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float, scale: float):
    """A pre-norm decoder layer over ``projection`` weights, for ``layer.step(x [T, H], delta, cos,
    sin [T, rotary_dim], slots [T], k_pool, v_pool, block_table, positions [T], key_start)`` ->
    (residual, MLP output): the same calls as a layer's forward through the functions above, made
    from C++ (one row's tokens: a decode step, a draft, a verify of up to 16 tokens)."""
    return extension().Layer(ln1, ln2, eps, qkv, o, gate_up, down, heads, kv_heads, head_dim, q_norm, k_norm,
                             qk_eps, scale)


# --- sampling -----------------------------------------------------------------------------------

NO_DRAFT_PROBS = torch.empty(0)  # philox_race's "one-hot drafts"


def argmax_usable(x: torch.Tensor) -> bool:
    """Whether ``argmax`` and ``greedy_verify`` take these logits: float32 on the CPU, not empty."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0 \
        and available()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] float32 -> [...] int64: torch.argmax(x, -1) (the first maximum; the first NaN
    where a row has one) in one pass a row, no thread hand-offs (a verify's output rows and a
    draft's pruned vocabulary: tens of microseconds a call through torch.argmax on this project's
    CPU, a few here)."""
    return extension().argmax_rows(x.detach().contiguous())


def greedy_verify(logits: torch.Tensor, drafts: torch.Tensor, depths: torch.Tensor | None) -> torch.Tensor:
    """``speculative.greedy_outcome(argmax(logits), drafts, depths)`` in one call: logits
    [R, k + 1, V] float32, drafts [R, k] int64, depths [R, 1] int64 or None -> the packed
    [R, k + 2] int64 outcome (drafts, accepted count, next token)."""
    return extension().greedy_verify(logits.detach().contiguous(), drafts, depths)


def sampling_usable(*probs: torch.Tensor | None) -> bool:
    """Whether ``race`` and ``nucleus_threshold`` take these distributions: float32 on the CPU
    (none needing a gradient), the kernels built."""
    return all(p is None or (p.device.type == "cpu" and p.dtype == torch.float32 and not p.requires_grad)
               for p in probs) and available()


def race(target: torch.Tensor, draft: torch.Tensor | None, drafts: torch.Tensor, depths: torch.Tensor,
         keys: torch.Tensor, fills: torch.Tensor) -> torch.Tensor:
    """Exact rejection sampling with the emitted token drawn by an exponential race, for rows at
    once, the noise drawn inside (Philox, as ``noise.fill`` draws it; its exponentials are
    ``philox_fill``'s, bit for bit): the decision ``speculative.rejection_outcome`` makes from
    ``noise.fill``'s uniforms and race, in one pass over each row's vocabulary instead of a dozen
    PyTorch ops and a materialised race (a 49,152-token race with one draft: about 36 us on this
    project's 2-core CPU against 222 us). target [R, k + 1, V] float32; draft [R, k, V] or None
    (one-hot drafts); drafts [R, k], depths [R] (each row's own number of drafts), keys [R] and
    fills [R, 2] (the fills of the row's acceptance uniforms and of its race; a race fill below 0:
    no noise, the argmax) int64 -> [R, k + 2] int64: drafts, accepted, token. k = 0: a sample.
    The residual is not divided by its mass: the same winner in exact arithmetic, and in float32
    the same except where two tokens' ratios lie within a rounding of each other (a reviewer's
    search found one such case in a 16-token row; either pick is an exact sample)."""
    return extension().philox_race(target.contiguous(), NO_DRAFT_PROBS if draft is None else draft.contiguous(),
                                   drafts, depths, keys, fills)


def nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top-p's threshold of each row of probs [N, V] at top_p [N] (float32) -> [N, 1]: the value
    ``sampling._nucleus_threshold`` finds by sorting, from the candidates above a bound (the same
    sorted prefix, so the same value; a row with top_p >= 1: 0). One row of 49,152 at T 0.7:
    about 0.43 ms through PyTorch's top-k and cumsum on this project's CPU."""
    return extension().nucleus_threshold(probs.contiguous(), top_p.to(torch.float32).contiguous())


def process_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  greedy: torch.Tensor) -> torch.Tensor:
    """``sampling.process_logits``' temperature, top-p and greedy rows in one call (top-k's cut
    before it and min-p's after it are the caller's: ``sampling._top_k_cut``, ``_min_p_rows``): logits
    [N, V] float32 and per row temperature, top_p [N] float32 and greedy [N] bool -> probs [N, V]
    float32 (a greedy row a one-hot of its first maximum; the others softmax at their temperature,
    then top-p by ``nucleus_threshold``'s threshold and renormalised). The same kept tokens as
    the PyTorch ops but where a token's probability lies within float32 rounding of top-p's (or,
    after it, min-p's) threshold, the probabilities within float32 rounding of theirs (another
    exp and summation order). One 49,152-token row of the default model at T 0.7, top-p 0.95: about 180 us
    through the PyTorch ops on this project's CPU (two threads)."""
    return extension().process_probs(logits.contiguous(), temperature.to(torch.float32).contiguous(),
                                     top_p.to(torch.float32).contiguous(), greedy.to(torch.bool).contiguous())
