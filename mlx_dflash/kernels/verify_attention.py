"""Our multi-row attention kernel inside the target's verify forward (Metal only).

mlx-lm's attention modules compute q, k, v, update the cache and then call ``scaled_dot_product_attention``,
the function of ``mlx_lm.models.base`` that each family module imports by name. There is no argument or
attribute to hook, so for the length of one verify call (``routing``) each decoder layer's attention child
is replaced, on this model instance only, by a ``RoutedAttention``: it runs the module's own ``__call__``
(the same code object, on the same module) through a function whose globals are a private copy of the
family module's globals with that one name bound to ``routed_sdpa``. After the call the original child is
put back. mlx-lm's classes, functions and module globals are never modified, so other models in the
process, and this one outside the verify forward (prefill, mlx-lm's own generate), are untouched.

``routed_sdpa`` sends a call to ``attention_kernels.block_attention`` (whose race gate picks ours or MLX's
per chip, shape, rows and cache-size bin, verdict cached on disk) only when the call is what the kernel
computes: a causal mask (the plain ``"causal"``: query row i of L sees keys 0 .. S - L + i; or the array a
batch cache built for rows of different lengths, each row then its own S, ``note_ragged_causal``) or a draft
tree's (each node sees the context and its ancestors, the array a tree forward built without a window,
``note_tree``), no attention sinks, an unquantized cache, and a shape ``check_supported`` accepts (2..16 rows,
head dim 64/128, GQA, one dtype). Anything else - other array masks (sliding windows), sinks (gpt-oss), quantized KV
caches, other head dims (e.g. 256) - goes to mlx-lm's own function, unchanged.

Families whose attention calls that function from a decoder layer's direct child are routed (llama,
mistral, qwen2, qwen3, qwen3_moe, the full-attention layers of qwen3_5 / qwen3_5_moe / qwen3_next,
gemma3's global layers, ...) wherever the call fits; gpt-oss (sinks) and MLA layers (a score array as
the mask) are wired but always fall back; families whose attention calls
``mx.fast.scaled_dot_product_attention`` itself, or sits deeper than a layer's child, are left as they are.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager

import mlx.nn as nn
from mlx_lm.models import base

from . import attention as attn
from . import routes
from .race_gate import MLX
from ..errors import DFlashError

SDPA_NAME = "scaled_dot_product_attention"
ROUTE_ENV = "MLX_DFLASH_ATTENTION_KERNEL"
ROUTES = ("auto", "dflash", "mlx")  # race gate / always ours where the call fits / never


def default_route() -> str:
    route = os.environ.get(ROUTE_ENV, "auto")
    if route not in ROUTES:
        raise DFlashError(f"{ROUTE_ENV}={route!r}: use one of {', '.join(ROUTES)}")
    return route


def install_sites(layers, route: str | None = None) -> tuple[list, str]:
    """(sites, route) for ``routing``: none off Metal or for route "mlx" (default: env, else auto)."""
    route = route or default_route()
    if route not in ROUTES:
        raise DFlashError(f"attention route {route!r}: use one of {', '.join(ROUTES)}")
    if route == "mlx" or not attn.metal_available():
        return [], "mlx"
    return attention_sites(layers), route


def _calls_base_sdpa(cls) -> bool:
    call = getattr(cls, "__call__", None)
    return (isinstance(call, types.FunctionType) and SDPA_NAME in call.__code__.co_names
            and call.__globals__.get(SDPA_NAME) is base.scaled_dot_product_attention)


def attention_sites(layers) -> list[tuple[nn.Module, str]]:
    """[(decoder layer, attribute)] of the attention modules that call mlx-lm's SDPA function."""
    return [(layer, name) for layer in layers if layer is not None
            for name, child in layer.items() if isinstance(child, nn.Module) and _calls_base_sdpa(type(child))]


# The last array mask our kernel computes, and what it computes it from: the causal mask a batch cache built for
# rows of different lengths (models/batch_cache.py), or a tree forward's (models/tree_verify.py), with the keys
# each row attends and, for a tree, the block keys each node sees. A call given this very array is routed: an
# identity test, nothing read back from the device.
_noted: tuple = (None, (), None)


def note_ragged_causal(mask, lengths: list):
    """A batch cache built `mask`: batch row b's queries are the last of its lengths[b] keys, each seeing the
    row's keys up to itself (no window)."""
    global _noted
    _noted = (mask, tuple(lengths), None)


def note_tree(mask, lengths: list, sees):
    """A tree forward built `mask`: batch row b's nodes are the last of its lengths[b] keys, each seeing the row's
    context and the nodes whose bits are set in sees[b, i] (its ancestors and itself; no window)."""
    global _noted
    _noted = (mask, tuple(lengths), sees)


def noted_mask(mask) -> tuple:
    """(each batch row's keys, the nodes' `sees` or None for causal) when `mask` is the array noted last; else
    (None, None)."""
    noted, lengths, sees = _noted
    return (list(lengths), sees) if mask is not None and mask is noted else (None, None)


def routing_of(queries, keys, values, cache, mask, sinks) -> tuple:
    """(why this SDPA call stays with MLX, None when our kernel computes exactly it; each batch row's keys when
    the mask is an array our kernel computes, else None; a tree's `sees`, else None), the mask looked up once."""
    if sinks is not None:
        return "attention sinks", None, None
    if hasattr(cache, "bits"):
        return "quantized KV cache", None, None
    plain = isinstance(mask, str) and mask == "causal"
    lengths, sees = (None, None) if plain else noted_mask(mask)
    if not plain and (lengths is None or max(lengths) != keys.shape[2]):  # not one of this call's keys: not ours
        return "not a causal mask (plain, or a batch cache's rows of their own lengths) nor a draft tree's", None, None
    return attn.check_supported(queries, keys, values, keys.shape[2], lengths, sees), lengths, sees


def why_not_routed(queries, keys, values, cache, mask, sinks) -> str | None:
    """Why this SDPA call stays with MLX (None when our kernel computes exactly it)."""
    return routing_of(queries, keys, values, cache, mask, sinks)[0]


def routed_sdpa(route: str):
    """A drop-in for mlx-lm's ``scaled_dot_product_attention`` that sends fitting calls to ours."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        reason, lengths, sees = routing_of(queries, keys, values, cache, mask, sinks)
        if reason is None:
            return attn.block_attention(queries, keys, values, scale, route=route, lengths=lengths, sees=sees)
        if queries.ndim == 4 and attn.MIN_ROWS <= queries.shape[2] <= attn.MAX_ROWS:  # a verify our kernel could take
            routes.record(attn.race_key(queries, keys, keys.shape[2]), MLX, reason, fallback=True)
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                                 sinks=sinks)

    return scaled_dot_product_attention


def _rebound(call: types.FunctionType, sdpa) -> types.FunctionType:
    """``call`` with its globals copied and SDPA_NAME bound to ``sdpa`` (the original is untouched)."""
    scope = dict(call.__globals__)
    scope[SDPA_NAME] = sdpa
    fn = types.FunctionType(call.__code__, scope, call.__name__, call.__defaults__, call.__closure__)
    fn.__kwdefaults__ = call.__kwdefaults__
    return fn


class RoutedAttention:
    """Stands in for one attention module during the verify call: its own code, our SDPA."""

    def __init__(self, module: nn.Module, call):
        self._module, self._call = module, call

    def __call__(self, *args, **kwargs):
        return self._call(self._module, *args, **kwargs)

    def __getattr__(self, name):  # the layer may read the module's attributes
        return getattr(self._module, name)


@contextmanager
def routing(sites: list, route: str):
    """Route the attention modules at ``sites`` through ``routed_sdpa(route)`` for one call."""
    sdpa, calls, swapped = routed_sdpa(route), {}, []
    try:
        for layer, name in sites:
            module = layer[name]
            cls = type(module)
            if not _calls_base_sdpa(cls):  # swapped since the sites were found: leave it alone
                continue
            if cls not in calls:
                calls[cls] = _rebound(cls.__call__, sdpa)
            swapped.append((layer, name, module))
            layer[name] = RoutedAttention(module, calls[cls])
        yield
    finally:
        for layer, name, module in swapped:
            layer[name] = module
