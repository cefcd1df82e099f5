"""Hugging Face transformers on codesign's kernels: paged and quantized KV caches inside `generate` (a latent cache
for DeepSeek's MLA), tree speculative decoding, quantized checkpoints through `from_pretrained`, and the same run
costed on a design.

Importing this package registers the attention function `codesign_paged` (and its mask entry) and the
quantizer `quant_method="codesign"` with transformers.
"""

import sys

from codesign.backend import enable_interpreter_if_no_gpu
from codesign.integrations.hf.support import check_transformers_version

# Without a GPU the Triton backend runs through the interpreter, which must be on before the kernels are defined
# (left alone if the caller imported them already: the torch backend still serves).
if not any(m.startswith("codesign.kernels") for m in sys.modules):
    enable_interpreter_if_no_gpu()
check_transformers_version()

from codesign.integrations.hf.attention import register as _register_attention  # noqa: E402
from codesign.integrations.hf.cache import CodesignCache  # noqa: E402
from codesign.integrations.hf.fuse import fuse_layers_, unfuse_layers_  # noqa: E402
from codesign.integrations.hf.graphs import GraphDecoding, GraphTape  # noqa: E402
from codesign.integrations.hf.latent import CodesignLatentCache  # noqa: E402
from codesign.integrations.hf.one_call import generate, run_generate  # noqa: E402
from codesign.integrations.hf.quantizer import (  # noqa: E402
    CodesignQuantConfig,
    from_quantized_checkpoint,
    load_gptq_awq,
)
from codesign.integrations.hf.speculative import ModelDraft, NGramDraft, TreeSpeculator, chain_tree  # noqa: E402
from codesign.integrations.hf.support import ATTN_NAME  # noqa: E402

_register_attention()

__all__ = [
    "ATTN_NAME", "CodesignCache", "CodesignLatentCache", "CodesignQuantConfig", "GraphDecoding", "GraphTape",
    "ModelDraft", "NGramDraft",
    "TreeSpeculator",
    "chain_tree", "from_quantized_checkpoint", "fuse_layers_", "generate", "load_gptq_awq", "run_generate",
    "unfuse_layers_",
]  # fmt: skip
