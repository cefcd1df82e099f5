"""The per-layer ops between a decoder layer's GEMMs and its attention, each one launch: RMSNorm (`rms_norm`; with
the residual add before it, `add_rms_norm`), rotary position embedding of q and k (`rope`), the gated product of a
gated MLP (`silu_mul`, `gelu_tanh_mul`); and hybrid models' recurrent steps (`state_ops`).

Why: Hugging Face's modules spell each as a chain of small torch ops (RMSNorm 6 in fp32, 8 in bf16; the rotary
embedding of q and k 10; the gated product 2): at decode they are hundreds of launches a step that each move a few
KB, which neither a CUDA graph nor a faster GEMM removes. The operator specs (`codesign.specs.Norm`, `RoPE`,
`Elementwise("silu_mul")` / `"gelu_mul"`) already cost each as one pass; these ops make the GPU run them so.
`integrations.hf.fuse` patches a model to use them.

    ops.py               the torch ops (checks, torch paths with Hugging Face's own arithmetic, backend choice)
    triton_rms_norm.py   one program a row (the residual added first for add_rms_norm)
    triton_rope.py       one program a token: every head of q and k, cos and sin read once
    triton_act_mul.py    act(gate) * up over rows of blocks of 1024 (SiLU, or GELU's tanh approximation)
    state_ops.py         hybrid models' recurrent layers as torch ops: `gated_delta_rule` (Gated DeltaNet over T
                         tokens), `ssd_scan` (Mamba-2 over a prompt), `ssd_update` (its one-token step, in place),
                         `selective_scan` (Mamba-1 over a prompt), `selective_state_update` (its step, in place)
    triton_gated_delta.py   the recurrence: one program a (sequence, value head, 32 value columns), its state slice
                            in registers for all T tokens
    triton_gated_delta_chunk.py   the chunked form (prompts): every chunk's inverse at once, then a walk over them
    tree_state_ops.py    `gated_delta_tree`, `ssd_tree`: Gated DeltaNet and Mamba-2 over a token tree (a tree
                         speculative step's nodes)
    triton_gated_delta_tree.py, triton_ssd_tree.py   their kernels: the chunked form of one chunk with the ancestor
                                                     mask, one launch
    triton_ssd_update.py    one program a (sequence, head, block of head-dim rows)
    triton_ssd_chunk.py     Mamba-2's scan over a prompt: one program a (sequence, head, 32 rows) walking the chunks
    triton_ssd_steps.py     its scan over a few tokens, token by token (the state read and written once)
    triton_selective_update.py   Mamba-1's one-token step (Jamba): one program a (sequence, block of channels)
    triton_selective_scan.py     Mamba-1's scan over a prompt: one program a (sequence, block of channels) walking
                                 chunks of tokens, each chunk an associative scan along its tokens
    gated_delta.py       Gated DeltaNet's linear attention (Qwen3-Next, Qwen3.5), the CPU reference of its recurrence
                         and chunked form (the kernel's reference; prompts run transformers' chunked form)
    ssd.py               Mamba-2's state-space scan (Granite 4.0 hybrid, Bamba, ...), the same two forms
    selective_scan.py    Mamba-1's selective scan (Jamba, Falcon-Mamba, Mamba), the CPU reference of its recurrence
    checks.py            the argument checks those three references share (any dtype, fp64 included)
"""
