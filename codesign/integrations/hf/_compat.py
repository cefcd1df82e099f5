"""Every difference between the transformers releases the integration serves (4.57, 5.23-5.25), in one place.

Read from those releases' sources (`cache_utils.py`, `masking_utils.py`, `quantizers/base.py`,
`modeling_utils.py`, each model's `forward`):

- the cache keyword of `forward` / `generate`: "cache" from 5.24 ("past_key_values" still accepted there,
  deprecated), "past_key_values" before;
- `Cache.get_mask_sizes` / `CacheLayerMixin.get_mask_sizes` take the query length (5.x) or the query's
  `cache_position` tensor (4.57);
- `Cache.crop` takes a negative count of tokens to remove (5.x; 0 is a no-op), or the length to keep (4.57;
  a negative count there too);
- the abstract capacity method is `get_max_length` (5.x) or `get_max_cache_shape` (4.57): the cache layer
  defines both, so nothing version-dependent is needed there;
- 4.57's weight loading (`_load_state_dict_into_meta_model`) casts every floating tensor of a quantized
  checkpoint to the load dtype before `param_needs_quantization` / `create_quantized_param` see it; 5.x
  keeps a pre-quantized checkpoint's dtypes (`QuantizerLoading`);
- 4.57 gives the model a copy of the quantization config (5.x the quantizer's own object): the quantizer
  records the converted layers on both (`quantizer.py`);
- 4.57 builds a quantized model through accelerate (`init_empty_weights`), which 5.x does not need;
- 5.25's assisted generation (prompt lookup) calls `Cache.activate_past_recording(recurrent_states_to_keep=...)`,
  earlier releases without an argument: `CodesignCache` takes it optionally (it has no recurrent states).
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
import transformers

VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
CROP_TAKES_LENGTH = VERSION < (5, 0)  # 4.x: crop(max_length); 5.x: crop(-tokens_to_remove)
CASTS_CHECKPOINT = VERSION < (5, 0)  # 4.x casts a quantized checkpoint's floating tensors to the load dtype


def cache_kwarg(model) -> str:
    """The name transformers' forward takes the cache under ("cache" from 5.24, "past_key_values" before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def query_length(arg) -> int:
    """get_mask_sizes' argument as a query length: an int (5.x) or the queries' cache_position (4.57)."""
    return int(arg.shape[0]) if isinstance(arg, torch.Tensor) else int(arg)


def tokens_to_remove(arg: int, seen: int) -> int:
    """crop's argument as a count of columns to drop from a cache of `seen`: 5.x passes -count (a positive
    value is refused there, as transformers' own layers refuse it); 4.57 passes the length to keep, or -count."""
    from codesign.specs import CodesignError

    if arg < 0:
        return -arg
    if CROP_TAKES_LENGTH:
        return max(seen - arg, 0)  # 4.57's DynamicLayer: a length at or above the cache's is a no-op
    if arg > 0:
        raise CodesignError(f"crop takes a negative count of tokens to remove, got tokens_to_remove={arg}")
    return 0


class QuantizerLoading:
    """Mixed into the "codesign" HfQuantizer. 4.57 casts every floating tensor of a quantized checkpoint to the
    load dtype (the default dtype when none is given) before any quantizer hook sees it, codesign modules'
    scales and biases included. The cast is exact when the load dtype is float32 or the tensor's own dtype:
    such loads get each tensor's saved dtype back after loading; any other is refused before loading. 5.x keeps
    a pre-quantized checkpoint's dtypes: nothing to do there."""

    _load_dtype: torch.dtype | None = None
    _saved_dtypes: dict | None = None

    def check_loader(self) -> None:
        """4.57 builds a quantized model on the meta device through accelerate's `init_empty_weights`."""
        if VERSION < (5, 0) and importlib.util.find_spec("accelerate") is None:
            from codesign.specs import CodesignError

            raise CodesignError(
                f"transformers {transformers.__version__} loads quantized models through accelerate: "
                "pip install accelerate"
            )

    def note_load_dtype(self, dtype: torch.dtype | None) -> None:
        """update_dtype's argument: the dtype 4.57 casts the checkpoint to."""
        self._load_dtype = dtype or torch.get_default_dtype()

    def check_load_casts(self, model, fqns) -> None:
        """Before loading (the modules of `fqns` rebuilt with their saved dtypes): refuse a lossy cast."""
        if not CASTS_CHECKPOINT:
            return
        self._saved_dtypes = {f: _float_buffers(model.get_submodule(f)) for f in fqns}
        load = self._load_dtype or torch.get_default_dtype()
        lossy = sorted({str(d) for bufs in self._saved_dtypes.values() for d in bufs.values()} - {str(load)})
        if load != torch.float32 and lossy:
            from codesign.specs import CodesignError

            raise CodesignError(
                f"transformers {transformers.__version__} casts a pre-quantized checkpoint's {', '.join(lossy)} "
                f"scales to dtype={load}, which loses bits: load it with dtype=torch.float32 (the recorded dtypes "
                "are put back), or with transformers >= 5.23"
            )

    def restore_saved_dtypes(self, model) -> None:
        """After loading: each codesign module's floating tensors back in their saved dtypes (exact casts)."""
        for fqn, bufs in (self._saved_dtypes or {}).items():
            module = model.get_submodule(fqn)
            for name, dtype in bufs.items():
                owner, _, leaf = name.rpartition(".")
                m = module.get_submodule(owner) if owner else module
                m._buffers[leaf] = m._buffers[leaf].to(dtype)
        self._saved_dtypes = None


def _float_buffers(module) -> dict[str, torch.dtype]:
    return {n: b.dtype for n, b in module.named_buffers() if b is not None and b.is_floating_point()}
