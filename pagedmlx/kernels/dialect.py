"""The portable kernel dialect: one kernel text, rendered for mx.fast.cuda_kernel or mx.fast.metal_kernel.

A source spells everything the two languages spell differently with the tokens below: thread and
group indices, SIMD-group (warp) lanes and shuffles, shared (threadgroup) memory and its barrier,
address-space qualifiers, the few math functions whose names differ. render() replaces each token
by its backend's spelling, whole words only, drops comments and fails if a token survives. The
rest is the C++ subset that CUDA and the Metal Shading Language share (templates, constexpr,
static_cast, reinterpret_cast, #pragma unroll), with three rules that Metal imposes:

- a pointer derived from a kernel argument is declared `auto` (MLX passes an input of fewer than
  8 elements in the `constant` address space, larger ones in `device`), or its type names DEVICE;
- helper functions take registers by `THREAD T&` and pointers as template parameters;
- thread indices are spelled only through tokens in the body, never in the header: MLX declares a
  Metal attribute (thread_position_in_grid, ...) only when the body's text names it.

Why a template step and not #define: MLX scans the body's text for the attributes it must declare,
and checks here (no CUDA name left in the Metal text, and the reverse) need the expanded text.
"""

from __future__ import annotations

import re

CUDA, METAL = "cuda", "metal"
BACKENDS = (CUDA, METAL)

# token -> (CUDA spelling, Metal spelling). A token ending in "(" matches the name and the paren.
TOKENS: dict[str, tuple[str, str]] = {
    "THREAD_IN_GROUP": ("threadIdx.x", "thread_position_in_threadgroup.x"),
    "GLOBAL_THREAD": ("(blockIdx.x * blockDim.x + threadIdx.x)", "thread_position_in_grid.x"),
    "GROUP_X": ("blockIdx.x", "threadgroup_position_in_grid.x"),
    "GROUP_Y": ("blockIdx.y", "threadgroup_position_in_grid.y"),
    "GROUP_Z": ("blockIdx.z", "threadgroup_position_in_grid.z"),
    "GROUPS_X": ("gridDim.x", "threadgroups_per_grid.x"),
    "GROUPS_Y": ("gridDim.y", "threadgroups_per_grid.y"),
    "LANE": ("(threadIdx.x & 31)", "thread_index_in_simdgroup"),
    "SIMD_ID": ("(threadIdx.x >> 5)", "simdgroup_index_in_threadgroup"),
    "SHFL_XOR(": ("__shfl_xor_sync(0xffffffff, ", "metal::simd_shuffle_xor("),
    "BARRIER(": ("__syncthreads(", "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup"),
    "SHARED": ("__shared__", "threadgroup"),
    "DEVICE": ("", "device"),
    "THREAD": ("", "thread"),
    "FUNC": ("__device__ inline", "inline __attribute__((always_inline))"),
    "LOAD16(": ("__ldg(", "*("),
    "EXP(": ("__expf(", "metal::exp("),
    "FMAX(": ("fmaxf(", "metal::max("),
    "FMIN(": ("fminf(", "metal::min("),
    "FABS(": ("fabsf(", "metal::abs("),
    "ROUND(": ("roundf(", "metal::round("),  # half away from zero in both
    "RSQRT(": ("rsqrtf(", "metal::precise::rsqrt("),
    "IMIN(": ("min(", "metal::min("),
    "IMAX(": ("max(", "metal::max("),
    "NEG_INF": ("__int_as_float(0xff800000)", "(-INFINITY)"),
    "FLOAT_BITS(": ("__float_as_uint(", "as_type<uint>("),
    "BITS_FLOAT(": ("__uint_as_float(", "as_type<float>("),
}
TOKEN_NAMES = tuple(t.rstrip("(") for t in TOKENS)

# Names that exist in one language only: the other backend's text must contain none of them.
# "name*": any word that starts with name; otherwise the whole word.
CUDA_ONLY = ("__shfl*", "__sync*", "__shared__", "__device__", "__global__", "__ldg", "__expf", "__int_as_float",
             "__nv_bfloat16*", "__half*", "__float*", "threadIdx", "blockIdx", "blockDim", "gridDim", "fmaxf", "fminf",
             "fabsf", "roundf", "rsqrtf",
             "asm", "cooperative_groups", "__restrict__", "__grid_constant__")
METAL_ONLY = ("threadgroup*", "simdgroup*", "simd_*", "thread_position*", "thread_index*", "threads_per*",
              "quadgroup*", "metal", "mem_flags", "device", "thread", "constant", "kernel", "INFINITY",
              "bfloat16_t", "float16_t", "always_inline", "as_type")

_TOKEN_RE = re.compile("|".join(
    r"\b" + re.escape(t) if t.endswith("(") else r"\b" + re.escape(t) + r"\b"
    for t in sorted(TOKENS, key=len, reverse=True)))
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def strip_comments(text: str) -> str:
    return _COMMENT_RE.sub("", text)


def render(text: str, backend: str) -> str:
    """The source in `backend`'s spelling, without comments. Raises if a dialect token survives."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    col = BACKENDS.index(backend)
    out = _TOKEN_RE.sub(lambda m: TOKENS[m.group(0)][col], strip_comments(text))
    out = re.sub(r"\n[ \t]*(?=\n)", "", out)  # the lines comments leave empty
    left = leftover_tokens(out)
    if left:
        raise ValueError(f"dialect tokens left after rendering for {backend}: {sorted(left)}")
    return out


def leftover_tokens(text: str) -> set[str]:
    return set(re.findall(r"\b(" + "|".join(TOKEN_NAMES) + r")\b", text))


def foreign_names(text: str, backend: str) -> set[str]:
    """Names of the other language found in `backend`'s text (whole words, or prefixes such as __shfl)."""
    names = METAL_ONLY if backend == CUDA else CUDA_ONLY
    found = set()
    for n in names:
        pattern = re.escape(n.rstrip("*")) + (r"\w*" if n.endswith("*") else r"\b")
        if re.search(r"(?<!\w)" + pattern, text):
            found.add(n)
    return found
