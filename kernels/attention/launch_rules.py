"""The paged attention kernel's launch rules (`triton_attention`): the default tile, warps and stages per cache
format, GPU and shape, the split count that fills one wave of the programs an SM holds, which code layout a tile
reads (words, code planes, KIVI's value planes), the extend and tree tiles, and the tuned tables they are looked up
in (`autotune.lookup`: a table's entry over the format's default).

The numbers below are compile-time evidence (sm_90 SASS, registers and the warp-scheduler prediction of
`bench/attention_predict.py` and `bench/attention_configs.py`) unless they say measured; a GPU's tuned tables
replace them per shape.
"""

from __future__ import annotations

from codesign.autotune.lookup import lookup_config, shape_key
from codesign.backend import device_view
from codesign.kernels.attention.options import MAX_SPLITS
from codesign.kernels.host_math import next_pow2
from codesign.kernels.kvcache.formats import (
    KV_FORMAT_FP8,
    KV_FORMAT_INT,
    KV_FORMAT_KIVI,
    KV_FORMAT_MIXED,
    KV_FORMAT_OAKEN,
    KV_FORMAT_OAKEN_OFFLINE,
    KV_FORMAT_PLAIN,
    table_suffix,
)
from codesign.kernels.triton_planes import plane_count

OP = "paged_attention"
# Each split should stream at least this many tokens: below it the reduction costs more than the
# parallelism gains (flash-decoding's rule of thumb).
MIN_TOKENS_PER_SPLIT = 256
# Past one wave of resident programs, the split counts tried for the fullest waves (`choose_num_splits`), and how close
# to the best a smaller count may come and still be taken (fewer partials to merge).
WAVE_SPLITS = 8
WAVE_SLACK = 1.05
DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
# Decode occupancy: a config's "PROGRAMS_PER_SM" P is the programs an SM holds at once (registers, shared memory),
# and the split count then fills exactly one wave of them (`choose_num_splits`): no second wave half empty. Without
# it the split rule aims at two waves of 4-warp programs, which at batch 16 left 6 programs an SM for 4 resident
# (INT4 / INT2 words on 2 warps: 2 waves; predicted 0.414 / 0.475 ms against 0.309 / 0.354 in one wave of 4, sm_90,
# batch 16, context 32k; `bench/attention_predict.py`, untimed). P per default is what the compiled tiles reach
# (sm_90, head_dim <= 128, 16-bit queries: 4-warp tiles of 105-128 registers and up to 40 KB shared 4; 2-warp
# tiles, up to 255 registers, 4; FP8's 144 registers on 4 warps 3; Oaken's 236 2), checked by
# `tests/bench/test_attention_predict.py`. Registers are capped (config key "MAXNREG", Triton's `maxnreg`) only where a
# cap fits more programs an SM without spilling and is predicted faster: the one-warp INT4 and KIVI INT4 tiles
# (PLANES_DECODE_CAP, KIVI_PLANES_CAP; where they raise the split count, `decode_occupancy`), Oaken's value walk
# (`oaken_split.CORR_MAXNREG`); a cap of 128 made ptxas spill the bf16 tile (105 registers uncapped). Tuned tables may
# set PROGRAMS_PER_SM and MAXNREG per config; a config with another tile inherits neither from the default
# (`launch_config`).
DECODE_PROGRAMS_PER_SM = {2: 4, 4: 4}  # by num_warps (one warp: PLANES_DECODE_PROGRAMS_PER_SM); 8 the two-wave rule
FP8_DECODE_PROGRAMS_PER_SM = 3
OAKEN_DECODE_PROGRAMS_PER_SM = 2  # its 64 x 128 tile on 4 warps (blocks of 32 and up): 236 registers
# Shared memory the default K/V tile pipeline may use: well under Hopper's 227 KiB and Ampere's
# 163 KiB per block, leaving room for Q and the layout conversions of tl.dot.
DEFAULT_SMEM_BUDGET = 96 * 1024
# Register budget of the untuned defaults for caches that dequantize in the inner loop, as the largest
# BLOCK_N x DIM_PAD tile: compiled for sm_90 at head_dim 128 and 4 warps (`bench/lowering_report.py`,
# ptxas), sub-byte codes read by byte gather (mixed chunks; INT4/INT2 and Oaken whose rows are not whole words)
# spill at BLOCK_N 32 (255 registers, 0.2-0.6 KB per thread; 1.2-8.6 KB at 64) and use 64-116 registers at
# 16; KIVI (words) 124-125 at 32 (INT4, INT2; `bench/attention_predict.py`). Per-token INT4/INT2 read as words are
# not capped: their 64 x 128 tile takes 127 registers on 4 warps without spilling, and on an H200 (batch 16,
# context 32k) ran 0.83 ms against 1.08 on 8 warps, 1.61 at 16 x 128 (tuning-pass timings,
# `bench/results/h200-2026-11-30-run2`).
SUBBYTE_TILE_ELEMS = 16 * 128
# Per-token INT2 and INT4 off head_dim 128 read as words (16-bit queries) decode 64 x 128 tiles on INT_WORDS_WARPS
# (with 4 / warps times the splits, `choose_num_splits`). By the warp-scheduler simulation that predicts the kernels
# the H200 timed within 0.69-2.04x (`bench/attention_configs.py`, sm_90, bf16, untimed) the loop is latency-bound and
# the best tile depends on the batch: at batch 16, context 32k, 32 x 128 on 2 warps (138 / 167 registers, INT4 /
# INT2: 3 warps a scheduler) is predicted 0.327 / 0.321 ms against this 0.414 / 0.475 (222 / 254 registers, 2 a
# scheduler); at batch 64 it is predicted twice as slow as this (2.35 / 1.95 ms against 1.22 / 1.41: shared-memory
# traffic-bound at 4 warps a scheduler). Kept until a GPU's tables decide per batch. (INT2 at head_dim 128 now takes
# the code planes' tile, below.)
INT_WORDS_WARPS = 2
# Per-token INT4 at head_dim 128 (16-bit queries) decodes code planes (`reads_planes`) on one warp a program, 32 x 128,
# PLANES_DECODE_PROGRAMS_PER_SM an SM: each plane dot's output is [16, 16], which more warps would compute once each
# (Triton cannot split 2 column tiles over 4 warps). By the scheduler simulation (sm_90, bf16, batch 16, context 32k,
# `bench/attention_configs.py`, untimed) 0.173 ms, 79 % of its byte floor's speed, against the joined tile's 0.309
# on 2 warps; 64 x 128 on one warp spills (255 registers), and planes on the 2-warp 64 x 128 tile 0.277. INT8 keeps
# its 4-warp tile, planes included (0.346 -> 0.268 ms, at its byte floor). Per-token INT2 at head_dim 128 takes the same
# tile over its int16 half-words (8 planes like INT4's, `plane_words`): 166 registers, 12 programs an SM, 654 SASS a
# tile with the unfinished planes (`word_planes_raw`), predicted 0.138 ms (52 % of its byte floor) against 0.338 on the
# joined 64 x 128 2-warp tile.
PLANES_DECODE_TILE = {"BLOCK_N": 32, "num_warps": 1}
# ... for up to 16 query rows (heads a kv head): past them a warp per 16 (`launch_config`). At 32 query heads on one kv
# head the one-warp tile spills (INT4 500 B, 255 registers; INT2 4 B); on 2 warps INT4 holds 166, no spills, predicted
# 0.376 -> 0.185 ms at batch 64, context 32k (INT2 0.191 -> 0.184); at 64 on one, 4 warps, 254, no spills, 0.518 ms
# against one warp's 1.081 with 3.7 KB spilled (2 warps: 96 B spilled, 0.445). sm_90, bf16, untimed: `bench/
# attention_predict.py --formats int4 int2 --no-tree --heads 32 1 --batch 64` (the one-warp figures: that tile forced).
PLANES_WARP_ROWS = 16
PLANES_DECODE_PROGRAMS_PER_SM = {4: 10, 2: 12}  # by bits: 184 / 166 registers, 10 / 12 one-warp programs an SM
# Register caps of the default one-warp tiles (config key "MAXNREG", Triton's `maxnreg`; 0 or absent: none): (cap,
# programs an SM at it), where a cap lets an SM hold more programs without spilling. INT4's tile holds 200 uncapped
# (10 an SM); capped at 168, 167 and 12 an SM, predicted 0.173 -> 0.148 ms (3.00x -> 3.50x bf16, 79 -> 93 % of its
# byte floor's speed; sm_90, bf16, batch 16, context 32k, `bench/attention_configs.py --formats int4 --block-n 32
# --warps 1 --stages 2 --per-sm 10 12 --maxnreg 0 168`, untimed). At 160 also 12 an SM (0.151); at 152, 13, it spills
# 20 B; with the unfinished planes (`word_planes_raw`) 184 uncapped, 160 at the cap, 0.153 -> 0.140 ms (at 152 it
# spills 20 B). INT2's 168 gained nothing (at 152, 13 an SM: 0.146 against 0.140). A cap lengthens a tile's chain a
# little, so a launch keeps it only where it raises the split count (`decode_occupancy`).
PLANES_DECODE_CAP = {4: (168, 12)}
# The caps were sized on sm_90's code at 4 query heads a kv head, and hold without spilling up to these groups (sm_90,
# bf16, `bench/attention_predict.py --heads` 32 8, 40 8, 28 4, 64 8 and 32 2: INT4 to 16; KIVI INT4 with the cap
# forced spills 60-272 B from 5); past them, and below CAPS_FROM, the tiles run uncapped (sm_80's KIVI INT4 tile spilled
# 44 B at 176, compiled once with the cap applied there; the sm_80 lowering report now compiles it uncapped).
PLANES_CAP_MAX_GROUP, KIVI_CAP_MAX_GROUP = 16, 4
CAPS_FROM = (9, 0)
# Mixed chunks read as words at most this wide, on 4 warps: a tile inside one block, or of two whole blocks where two
# fill it (each read at its own width, `mixed_span_codes`). sm_90, bf16, head_dim 128, batch 16, context 32k
# (`bench/attention_predict.py`): blocks of 32, 64 x 128 over two blocks takes 128 registers and 682-705 SASS a tile
# (0.187 ms predicted), against 421-436 a 32-token tile in one block (108 registers, 0.230 ms); before the subnormal
# unpack (`chunk_words_f16`) and the unmasked rows (`mixed_span_codes`) 828-879 (0.232) against 483-506 (0.267), and,
# not recounted since: blocks of 64, 64 x 128 in one block 150 registers, 785 SASS (0.208; 32 x 128: 530, 0.279);
# blocks of 16 keep 16 x 128 (420 SASS, 0.439: two blocks, 825 a 32-token tile at 140 registers, 0.432, not taken for
# 2 %). None measured. Earlier, 32 x 128 on 8 warps (394 SASS, 0.41 ms), 16 x 128 on 2 (586, 0.41) and on 8 (446,
# 0.93) predicted slower.
MIXED_WORDS_TILE = 64
# KIVI's tile where it fits in a block, on KIVI_WORDS_WARPS (16-bit queries; fp32 4). By the same simulation
# (`bench/attention_configs.py`, G = R = 32, blocks of 32, batch 16, context 32k): 32 x 128 on 4 warps, 124 registers,
# 3 warps a scheduler, 0.467 / 0.453 ms (INT4 / INT2); on 2 warps (216-219 registers, 2 a scheduler) 0.587 / 0.515;
# 16 on 2 0.488 / 0.441. Also ahead on 2 at batch 64 (1.63 against 1.75 ms at 32k) and at 8k.
KIVI_WORDS_TILE = 32
KIVI_WORDS_WARPS = 4
# KIVI INT4 / INT2 at head_dim 128 with enough (sequence, kv head) pairs to fill the SMs decodes on one warp, its value
# tiles as code planes too (`reads_value_planes`): predicted (sm_90, bf16, blocks of 32, `bench/attention_configs.py
# --batch`) faster than the 4-warp tile from batch 4 at 8 kv heads (at 8k / 32k: batch 4 26 / 82 us against 30 / 103,
# batch 16 83 / 309 against 103 / 395) and slower at batch 1 (20 / 34 against 13 / 30; batch 2 splits the two); 254
# registers, 8 programs an SM. KIVI INT2 over half-words (`plane_words`) alike: 178 registers, 11 an SM; at 8k / 32k
# batch 4 27 / 68 us against 31 / 103, batch 16 69 / 242 against 103 / 391, batch 1 23 / 37 against 13 / 31.
KIVI_PLANES_DECODE_TILE = {"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "VPLANES": 1}
KIVI_PLANES_PROGRAMS_PER_SM = {4: 8, 2: 11}  # by bits
# KIVI INT4's tile holds 254 registers uncapped (8 an SM, 2 warps a scheduler, latency-bound: 0.309 ms, 1.67x bf16);
# capped at 176, 11 an SM without spilling: 0.264 ms (1.96x), as PLANES_DECODE_CAP was chosen (at 184 / 200, 10 an
# SM: 0.287 / 0.341; at 168, 12, it spills 64 B). KIVI INT2's 178 gains nothing (at 168: 28 B of spills).
KIVI_PLANES_CAP = {4: (176, 11)}
KIVI_PLANES_MIN_PAIRS = 32
# Tree verification adds the ancestor mask to a 16-token x GROUP_PAD-row extend tile, one 64-bit window of
# packed mask bits per row (`tree_mask_words`): at most 64 wide. Compiled for sm_90 in bf16 at head_dim 128
# (batch 16, 64 nodes over 4k): 64 x 4 warps takes 232 registers, no spills (2 programs an SM, as the extend),
# 780 SASS a prefix tile and 954 the masked one (`bench/attention_predict.py`); the byte mask read as a 2-D
# tile put the softmax in a second layout (196 SHFL.BFLY) and spilled 312 B on 4 warps (243 registers on 8).
# FP8 at 64 x 4 takes 228; INT8 / INT4 per token spill 44-72 B there and take 216 on 8 warps: caches other
# than these two run a 64-wide tree tile on at least TREE_MIN_WARPS.
TREE_MAX_BLOCK_N = 64
TREE_MIN_WARPS = 8
TREE_FOUR_WARP_FORMATS = (KV_FORMAT_PLAIN, KV_FORMAT_FP8)
# Extend launches follow the tree's warps rule (sm_90, bf16, 64 x 128 on 4 warps: INT8 spilled 20 B, INT2 16 B;
# 8 warps: 221 registers). Oaken's extend and tree rows are all real heads: the outlier corrections' [64,
# BLOCK_N] and the value scratch spilled at 64 x 128 (blocks of 32: 960 B on 4 warps, the tree 324 B on 8).
# Without warpgroup MMA (sm_80 / sm_89: mma.sync keeps both dot operands and the accumulators in registers)
# every 64 x 128 rows tile spilled on 4 warps (bf16 extend 80 B, tree 112 B; 8 warps: 172 / 193 registers)
# and the integer-coded caches' also on 8 (INT8 extend 112 B, tree 164 B) until the query rows halved (196-212
# registers with 32 rows). Compile-only evidence, untimed.
ROWS_OAKEN_BLOCK_N = 32
# ... and on 32 query rows: while its index was read as 8-byte (coordinate, delta) pairs the 64-row tree tile took
# 255 registers and spilled 40 B (sm_90, bf16, 32 x 128 on 8 warps; the extend 254); 32 rows: 249 and 178 (not
# measured again since a slot is one 4-byte word).
ROWS_OAKEN_M = 32
# The offline variant's tree (its grid decode beside the mask) spilled 16 B even at 32 rows (255 registers; 32 x 16
# too); at 16 rows: 174.
ROWS_OAKEN_OFFLINE_TREE_M = 16
# A mixed cache's tree tile over two blocks (64 x 128) spilled 164 B on 8 warps (sm_90, bf16; 120 B on 4); one
# block a tile, 32 x 128 on 8 warps, takes 205 registers.
ROWS_MIXED_TREE_BLOCK_N = 32
ROWS_SYNC_MMA_CODED_M = 32
# Oaken's decode tile is 64 x 128 on 4 warps for blocks of at least this many tokens (sm_90, bf16, head_dim 128, blocks
# of 32: 236 registers, no spills), else 32 x 128 on 8 warps (blocks of 16: 64 x 4 compiles without spills, 229
# registers, but is not predicted against 32 x 8).
OAKEN_WIDE_BLOCK = 32


def choose_num_splits(
    programs: int, max_kv_len: int, sms: int | None, warps: int = 4, per_sm: int | None = None
) -> int:
    """The one split-KV heuristic: split only when `programs` (q-blocks x kv heads) leave SMs idle.

    With `per_sm` (the programs an SM holds at once: a config's "PROGRAMS_PER_SM"): one full
    wave, splits = min(per_sm * sms // programs, cap), at least 1; past one wave (more programs than per_sm * sms
    slots), the split count s in 1..WAVE_SPLITS (within the cap) whose waves are fullest, time ~ ceil(programs * s /
    slots) / s, the smallest within WAVE_SLACK of the best (512 programs on 396 slots: 3 splits, 4 waves of a third
    of the keys, where 1 left a second wave under a third full). Else
    splits = min(ceil(2 * sms / programs), cap), at least 1: aim for two waves of programs. The cap,
    max_kv_len // MIN_TOKENS_PER_SPLIT and MAX_SPLITS, keeps splits at least MIN_TOKENS_PER_SPLIT tokens long.
    The two-wave rule counts 4-warp programs: programs of `warps` < 4 split 4 / warps times as often (within
    the same caps), so the SMs hold as many warps as the 4-warp plan would. Depends only on host-known sizes
    (no sync), so a plan made once serves CUDA-graph replays. On CPU (sms None) an H100-sized 132 SMs is
    assumed, so interpreter runs take the same path a GPU would.
    """
    sms = 132 if sms is None else sms
    cap = min(max_kv_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    if programs <= 0:
        return 1
    if per_sm is not None:
        if isinstance(per_sm, bool) or not isinstance(per_sm, int) or per_sm < 1:
            raise ValueError(f"PROGRAMS_PER_SM must be a positive int, got {per_sm!r}")
        slots = per_sm * sms
        if programs <= slots:
            return max(1, min(slots // programs, cap))
        waves = {s: -(-programs * s // slots) / s for s in range(1, max(1, min(cap, WAVE_SPLITS)) + 1)}
        return min(s for s, t in waves.items() if t <= WAVE_SLACK * min(waves.values()))
    splits = 1 if programs >= sms else max(1, min(-(-2 * sms // programs), cap))
    if warps < 4:
        splits = max(splits, min(splits * (4 // warps), cap))
    return splits



def default_config(
    head_dim: int, elem_bytes: int, kv_format: int = KV_FORMAT_PLAIN, bits: int = 16, block_size: int | None = None
) -> dict:
    """Untuned defaults sized so the pipelined K and V tiles fit in shared memory:
    num_stages * 2 * BLOCK_N * dim_pad * elem_bytes <= DEFAULT_SMEM_BUDGET; at head_dim 256 also 8 warps
    and 32 rows (a 64 x 256 fp32 accumulator would be 128 registers per thread over 4 warps). Caches that
    unpack codes in the inner loop also keep BLOCK_N x dim_pad within a register budget
    (SUBBYTE_TILE_ELEMS) so the kernel does not spill; per-token INT4 / INT2 read as words decode on
    INT_WORDS_WARPS (16-bit queries). With `block_size` known, KIVI takes
    KIVI_WORDS_TILE on KIVI_WORDS_WARPS (16-bit queries; fp32 4) where a block holds whole tiles (else its measured
    16-row tile on 2 warps), and mixed chunks read as words (`mixed_reads_words`) MIXED_WORDS_TILE on 4 warps."""
    cfg = dict(DEFAULT_CONFIG)
    dp = dim_pad(head_dim)
    while (
        cfg["BLOCK_N"] > 16 and cfg["num_stages"] * 2 * cfg["BLOCK_N"] * dp * elem_bytes > DEFAULT_SMEM_BUDGET
    ):
        cfg["BLOCK_N"] //= 2
    oaken = kv_format in (KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE)
    mixed_bn = min(cfg["BLOCK_N"], MIXED_WORDS_TILE, block_size or 0)
    if elem_bytes == 2 and 2 * mixed_bn == min(cfg["BLOCK_N"], MIXED_WORDS_TILE):
        mixed_bn *= 2  # two whole blocks a tile (fp32 queries: not; 32 x 128 over blocks of 16 spilled 452 B, sm_90)
    mixed_words = mixed_bn >= 16 and mixed_reads_words(kv_format, head_dim, block_size, mixed_bn)  # a dot's K >= 16
    gathered = (kv_format == KV_FORMAT_MIXED and not mixed_words) or (
        (kv_format == KV_FORMAT_INT or oaken) and bits < 8 and not reads_words(kv_format, bits, head_dim)
    )
    if gathered:  # sub-byte codes read by byte gather
        cfg["BLOCK_N"] = max(16, min(cfg["BLOCK_N"], SUBBYTE_TILE_ELEMS // dp))
    elif kv_format == KV_FORMAT_INT and bits in PLANES_DECODE_PROGRAMS_PER_SM and head_dim == 128 and elem_bytes == 2:
        cfg.update(PLANES_DECODE_TILE)  # (`reads_planes`; extend and tree launches widen it, `rows_config`)
    elif kv_format == KV_FORMAT_INT and bits < 8 and reads_words(kv_format, bits, head_dim) and elem_bytes == 2:
        cfg["num_warps"] = INT_WORDS_WARPS  # (fp32 queries keep 4: their IEEE dots spill more on 2)
    elif oaken and block_size is not None and block_size >= OAKEN_WIDE_BLOCK:
        cfg["BLOCK_N"], cfg["num_warps"] = min(cfg["BLOCK_N"], 64), 4
    elif oaken:
        cfg["BLOCK_N"], cfg["num_warps"] = min(cfg["BLOCK_N"], 32), 8
    kivi_wide = cfg["BLOCK_N"] >= KIVI_WORDS_TILE and block_size is not None and block_size % KIVI_WORDS_TILE == 0
    if kv_format == KV_FORMAT_KIVI and kivi_wide:
        cfg["BLOCK_N"], cfg["num_warps"] = KIVI_WORDS_TILE, KIVI_WORDS_WARPS if elem_bytes == 2 else 4
    elif kv_format == KV_FORMAT_KIVI:
        # 16 x 128 on 2 warps: the fastest config of three H200 tuning passes at batch 16 (context 32k: 6.1 ms
        # against 10.4 at 64 x 128 on 8 warps; the kernel then gathered its scales and selected ring rows per tile).
        cfg["BLOCK_N"], cfg["num_warps"] = 16, 2
    if mixed_words:
        cfg["BLOCK_N"], cfg["num_warps"] = mixed_bn, 4
    elif kv_format == KV_FORMAT_MIXED:
        cfg["num_warps"] = 8  # three code widths in one loop: 4 warps spill without a split (128 regs + 8 B)
    if dp >= 256:
        cfg["num_warps"] = 8
        cfg["BLOCK_M"] = 32  # and half the query rows: Q and the accumulator stay in registers
    per_sm = _decode_programs_per_sm(kv_format, cfg["num_warps"], bits)
    if dp <= 128 and elem_bytes == 2 and not gathered and per_sm is not None:
        cfg["PROGRAMS_PER_SM"] = per_sm
    return cfg


def default_cap(cfg: dict, kv_format: int, bits: int, group: int) -> dict:
    """A default decode config with its tile's register cap (`with_cap`) where one is known to fit `group` query heads
    a kv head: the one-warp INT4 tile (PLANES_DECODE_CAP) and KIVI INT4's value-planes tile (KIVI_PLANES_CAP)."""
    if "PROGRAMS_PER_SM" not in cfg or cfg["num_warps"] != 1:
        return cfg
    if kv_format == KV_FORMAT_INT and bits in PLANES_DECODE_CAP and group <= PLANES_CAP_MAX_GROUP:
        return with_cap(cfg, *PLANES_DECODE_CAP[bits])
    if kv_format == KV_FORMAT_KIVI and cfg.get("VPLANES") and bits in KIVI_PLANES_CAP and group <= KIVI_CAP_MAX_GROUP:
        return with_cap(cfg, *KIVI_PLANES_CAP[bits])
    return cfg


def with_cap(cfg: dict, cap: int, per_sm: int) -> dict:
    """cfg with register cap `cap` at `per_sm` programs an SM, its programs an SM without the cap kept as
    "UNCAPPED_PER_SM" (`decode_occupancy` takes whichever plan pays)."""
    return {**cfg, "MAXNREG": cap, "UNCAPPED_PER_SM": cfg["PROGRAMS_PER_SM"], "PROGRAMS_PER_SM": per_sm}


def decode_occupancy(cfg: dict, programs: int, max_kv_len: int, sms: int | None, num_splits: int | None = None,
                     capability: tuple[int, int] | None = None) -> dict:  # fmt: skip
    """cfg for a decode launch of `programs` (sequences x kv heads) over `max_kv_len` keys: with an
    "UNCAPPED_PER_SM" (a default's register cap, `with_cap`), the cap dropped (and the programs an SM with it) where
    the launch would split as many ways without it and fit in one wave of the uncapped programs (the cap only
    lengthens the tile's chain there: batch 1, short contexts, Oaken at batch 64), and on GPUs below CAPS_FROM;
    `num_splits`: the caller's."""
    unc = cfg.get("UNCAPPED_PER_SM")
    if unc is None:
        return cfg
    cfg = {k: v for k, v in cfg.items() if k != "UNCAPPED_PER_SM"}
    per = cfg.get("PROGRAMS_PER_SM")
    w = cfg["num_warps"]
    s = num_splits or choose_num_splits(programs, max_kv_len, sms, w, per)
    same = s == (num_splits or choose_num_splits(programs, max_kv_len, sms, w, unc))
    if (same and programs * s <= unc * (sms or 132)) or (capability is not None and capability < CAPS_FROM):
        cfg = {k: v for k, v in cfg.items() if k != "MAXNREG"} | {"PROGRAMS_PER_SM": unc}
    return cfg



def _decode_programs_per_sm(kv_format: int, warps: int, bits: int) -> int | None:
    """A default decode tile's occupancy (DECODE_PROGRAMS_PER_SM and its kin): what the compiled tiles are known to
    fit, by format, warps and (one warp) code bits."""
    if kv_format in (KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE):
        return OAKEN_DECODE_PROGRAMS_PER_SM if warps == 4 else None
    if warps == 1:  # the code planes' tile (PLANES_DECODE_TILE)
        return PLANES_DECODE_PROGRAMS_PER_SM.get(bits)
    return FP8_DECODE_PROGRAMS_PER_SM if kv_format == KV_FORMAT_FP8 else DECODE_PROGRAMS_PER_SM.get(warps)



def reads_words(kv_format: int, bits: int, head_dim: int) -> bool:
    """True when the kernel reads this cache's packed sub-byte codes as int32 words (`load_codes`): the INT,
    KIVI and Oaken formats below 8 bits whose code rows are whole words (not mixed chunks: their width varies
    per block). Words, not a byte gather: a gather loads (and holds in registers) each byte 8 / BITS times."""
    words_formats = (KV_FORMAT_INT, KV_FORMAT_KIVI, KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE)
    return kv_format in words_formats and bits < 8 and (head_dim * bits) % 32 == 0



# INT8 codes are read as int32 words by default too (config key "WORDS8", a tuning parameter; 0 reads bytes): the
# byte tile takes one 8-bit shared-memory load per element and more registers (sm_90: 140 against 100).
WORDS8_DEFAULT = 1
# Per-token INT4 / INT8 decode dots code planes (`reads_planes`; config key "PLANES", 0 for the joined fp16 tile).
PLANES_DEFAULT = 1
# KIVI decode on few enough warps may dot its value tiles' code planes too (`reads_value_planes`; config key "VPLANES",
# 1): off but on the one-warp tile the default takes from enough pairs (`kivi_planes_default`).
VPLANES_DEFAULT = 0


def mixed_reads_words(kv_format: int, head_dim: int, block_size: int, block_n: int) -> bool:
    """True when a mixed-precision launch reads its codes as int32 words: every tile lies in one block (one
    width) or is two whole blocks of at least 16 tokens (each read at its own width, a dot per block: a dot's
    dimensions are at least 16), and rows of every width (8, 4, 2 bits) are whole words."""
    span = block_n == 2 * block_size and block_size >= 16
    return kv_format == KV_FORMAT_MIXED and head_dim % 16 == 0 and (block_size % block_n == 0 or span)



def decode_path_on(q, batch, cache_shape: tuple[int, ...], kv_format: int, bits: int, key: str, default: int) -> bool:
    """Whether a format's decode config (tuned table or defaults) turns on the decode path `key` (the mixed cache's
    "BY_WIDTH", Oaken's "SPLIT"), `default` when it does not say. q: the queries (or a tensor of their shape, dtype
    and device); cache_shape: (num_blocks, block_size, kv_heads, head_dim, ..)."""
    _, bs, hkv, dim = cache_shape[:4]
    cfg = launch_config(q.shape[1], hkv, dim, bs, batch.block_tables.shape[0], q.device, q.element_size(), kv_format,
                        bits)  # fmt: skip
    return bool(cfg.get(key, default))


def table_op(kv_format: int = KV_FORMAT_PLAIN, bits: int = 16) -> str:
    """The tuned-table name for a cache format: "paged_attention" for plain caches, else
    "paged_attention_<suffix>" (`kvcache.formats.table_suffix`: int8/int4/int2, fp8, kivi, mixed, oaken), as
    `codesign tune` exports them: dequantizing in the inner loop moves the best tile size, so each format has
    its own table."""
    suffix = table_suffix(kv_format, bits)
    return OP if suffix is None else f"{OP}_{suffix}"



def table_key(q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> str:
    """The attention tables' shape key (M: the sequences in the batch)."""
    return shape_key(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)



def launch_config(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    batch: int,
    device,
    elem_bytes: int = 2,
    kv_format: int = KV_FORMAT_PLAIN,
    bits: int = 16,
) -> dict:
    """Tile sizes and warps from the tuned tables (`default_config` on CPU or untuned GPUs); tree launches
    adjust them with `tree_config`.

    Table key: shape_key(q_heads, kv_heads, head_dim, block_size); the M bucket is the batch size. A
    quantized cache reads its format's table (`table_op`), else its format's defaults: not the plain
    cache's table, whose best tile can spill registers once codes are unpacked in the loop.
    """
    key = table_key(q_heads, kv_heads, head_dim, block_size)
    gpu = device_view(device).gpu_name
    op = table_op(kv_format, bits)
    base = default_config(head_dim, elem_bytes, kv_format, bits, block_size)
    if kivi_planes_default(kv_format, bits, head_dim, elem_bytes, base, batch * kv_heads):
        base.update(KIVI_PLANES_DECODE_TILE, PROGRAMS_PER_SM=KIVI_PLANES_PROGRAMS_PER_SM[bits])
    rows = next_pow2(q_heads // kv_heads)  # a decode program's query rows
    if kv_format == KV_FORMAT_INT and base["num_warps"] == 1 and rows > PLANES_WARP_ROWS:
        # the one-warp planes tile past 16 rows: a warp per 16 (its PROGRAMS_PER_SM was sized for one)
        base = {k: v for k, v in base.items() if k not in OCCUPANCY} | {"num_warps": rows // PLANES_WARP_ROWS}
    base = default_cap(base, kv_format, bits, q_heads // kv_heads)
    # the default's occupancy (its programs an SM, its register cap) for the default's tile only
    occ = {k: base.pop(k) for k in OCCUPANCY if k in base}
    cfg = lookup_config(op, gpu, batch, key, base)  # (its PROGRAMS_PER_SM, MAXNREG, if any, the table's or forced)
    if same_tile(cfg, base) and not set(OCCUPANCY) & set(cfg):
        cfg |= occ
    return cfg


def same_tile(cfg: dict, base: dict) -> bool:
    """True when config `cfg` is `base`'s tile (OCCUPANCY_KEYS, a key left out at its default)."""
    return all(_key(cfg, k) == _key(base, k) for k in OCCUPANCY_KEYS)



def kivi_planes_default(kv_format: int, bits: int, head_dim: int, elem_bytes: int, base: dict, pairs: int) -> bool:
    """True when a KIVI decode launch's default is KIVI_PLANES_DECODE_TILE instead of `base` (`default_config`'s
    tile): INT4 or INT2 at head_dim 128, 16-bit queries, blocks holding whole KIVI_WORDS_TILE tiles, and at least
    KIVI_PLANES_MIN_PAIRS (sequence, kv head) pairs."""
    wide = base["BLOCK_N"] == KIVI_WORDS_TILE and base["num_warps"] == KIVI_WORDS_WARPS
    kivi = kv_format == KV_FORMAT_KIVI and bits in KIVI_PLANES_PROGRAMS_PER_SM and head_dim == 128 and elem_bytes == 2
    return kivi and wide and pairs >= KIVI_PLANES_MIN_PAIRS



# What a default "PROGRAMS_PER_SM" and "MAXNREG" were sized for: a tuned or forced config changing any of these
# inherits neither; one that sets either keeps what it sets and inherits nothing.
# A key a config leaves out has its default (a tuner candidate spelling out PLANES 1 is the default's tile).
OCCUPANCY_KEYS = ("BLOCK_N", "BLOCK_M", "num_warps", "num_stages", "WORDS8", "PLANES", "VPLANES")
OCCUPANCY = ("PROGRAMS_PER_SM", "MAXNREG", "UNCAPPED_PER_SM")  # a config's occupancy: inherited (or set) together


def _key(cfg: dict, k: str):
    """cfg's value of config key k, its default where it has none."""
    return cfg.get(k, {"WORDS8": WORDS8_DEFAULT, "PLANES": PLANES_DEFAULT, "VPLANES": VPLANES_DEFAULT}.get(k))


def tree_config(cfg: dict, kv_format: int = KV_FORMAT_PLAIN) -> dict:
    """`cfg` for a tree-verification launch: BLOCK_N at most TREE_MAX_BLOCK_N (the mask window), and at that
    width at least TREE_MIN_WARPS warps but for TREE_FOUR_WARP_FORMATS (see TREE_MAX_BLOCK_N)."""
    bn = min(cfg["BLOCK_N"], TREE_MAX_BLOCK_N)
    raise_warps = bn >= TREE_MAX_BLOCK_N and kv_format not in TREE_FOUR_WARP_FORMATS
    warps = max(cfg["num_warps"], TREE_MIN_WARPS) if raise_warps else cfg["num_warps"]
    return {**cfg, "BLOCK_N": bn, "num_warps": warps}



def rows_config(cfg: dict, kv_format: int, is_tree: bool, capability: tuple[int, int] | None) -> dict:
    """`cfg` for an extend or tree launch, whose programs hold a 64-row query tile (decode's hold one head
    group), so that it does not spill: Oaken's corrections at most ROWS_OAKEN_BLOCK_N wide on 8 warps and
    ROWS_OAKEN_M query rows (its offline variant's tree ROWS_OAKEN_OFFLINE_TREE_M); a tree at most
    TREE_MAX_BLOCK_N wide (a mixed cache's ROWS_MIXED_TREE_BLOCK_N on 8 warps); a 64-wide tile on TREE_MIN_WARPS
    for caches outside TREE_FOUR_WARP_FORMATS; and on GPUs without warpgroup MMA (capability below 9.0)
    TREE_MIN_WARPS for every cache and ROWS_SYNC_MMA_CODED_M query rows for the coded ones; at least 4 warps
    always. The table's tile is kept otherwise (decode and rows launches share a format's table, bucketed by batch)."""
    fmt = kv_format
    # Decode's tile holds one head group (16 rows): a config of fewer warps (INT_WORDS_WARPS, KIVI_WORDS_WARPS)
    # is a decode choice, and 64 query rows take at least 4; so is its occupancy (a 64-row tile takes more registers).
    cfg = {k: v for k, v in cfg.items() if k not in OCCUPANCY}
    if cfg["num_warps"] == 1:  # the code planes' one-warp decode tiles: rows take the tile they had before
        cfg["BLOCK_N"] = max(cfg["BLOCK_N"], KIVI_WORDS_TILE if fmt == KV_FORMAT_KIVI else DEFAULT_CONFIG["BLOCK_N"])
    cfg["num_warps"] = max(cfg["num_warps"], 4)
    if fmt in (KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE):
        rows = ROWS_OAKEN_OFFLINE_TREE_M if is_tree and fmt == KV_FORMAT_OAKEN_OFFLINE else ROWS_OAKEN_M
        cfg = {**cfg, "BLOCK_N": min(cfg["BLOCK_N"], ROWS_OAKEN_BLOCK_N), "num_warps": max(cfg["num_warps"], 8),
               "BLOCK_M": min(cfg["BLOCK_M"], rows)}
    if is_tree and fmt == KV_FORMAT_MIXED:
        cfg = {**cfg, "BLOCK_N": min(cfg["BLOCK_N"], ROWS_MIXED_TREE_BLOCK_N), "num_warps": max(cfg["num_warps"], 8)}
    if is_tree:
        cfg = tree_config(cfg, fmt)
    elif cfg["BLOCK_N"] >= TREE_MAX_BLOCK_N and fmt not in TREE_FOUR_WARP_FORMATS:
        cfg = {**cfg, "num_warps": max(cfg["num_warps"], TREE_MIN_WARPS)}
    if capability is not None and capability < (9, 0):
        cfg = {**cfg, "num_warps": max(cfg["num_warps"], TREE_MIN_WARPS)}
        if fmt not in TREE_FOUR_WARP_FORMATS:
            cfg["BLOCK_M"] = min(cfg["BLOCK_M"], ROWS_SYNC_MMA_CODED_M)
    return cfg



def tile_blocks(block_n: int, block_size: int) -> int:
    """Most cache blocks one BLOCK_N-token tile can touch; tiles start at multiples of BLOCK_N."""
    if block_size % block_n == 0:
        return 1
    if block_n % block_size == 0:
        return block_n // block_size
    return -(-(block_n - 1) // block_size) + 1



def dim_pad(head_dim: int) -> int:
    """head_dim rounded up to a power of two (tl.arange) and to >= 16 (the GPU's smallest tl.dot K)."""
    return max(16, next_pow2(head_dim))



def rows_layout(group: int, block_m: int, is_decode: bool, min_rows: int) -> tuple[int, int]:
    """(GROUP_PAD, BLOCK_Q): rows = BLOCK_Q tokens x GROUP_PAD heads, at least `min_rows` (the device's smallest
    tl.dot, `DeviceView.min_dot_rows`)."""
    gpad = next_pow2(group)
    bq = 1 if is_decode else max(1, block_m // gpad)
    gpad = max(gpad, min_rows // bq)
    return gpad, bq



def reads_value_planes(kv_format: int, bits: int, head_dim: int, cfg: dict) -> bool:
    """True when a KIVI decode launch that dots its key tiles' code planes (`reads_planes`) dots its value tiles'
    too (`kivi_value_planes`; config key "VPLANES", default VPLANES_DEFAULT): a value plane dot's output has a row's
    words (INT2: half-words) as columns (16 at INT4 and INT2, head_dim 128), so no more warps than its 8-column tiles.
    The kernel also needs value groups of whole words (its KIVI_PAIRS)."""
    if kv_format != KV_FORMAT_KIVI or bits not in (2, 4, 8) or not cfg.get("VPLANES", VPLANES_DEFAULT):
        return False
    return head_dim // plane_count(bits) // 8 >= cfg.get("num_warps", 1)



def reads_planes(kv_format: int, bits: int, head_dim: int, cfg: dict) -> bool:
    """True when a decode launch over code words (16-bit queries) dots them plane by plane (`word_planes`, the
    kernel's PLANES; config key "PLANES", default PLANES_DEFAULT): per-token INT keys and values, KIVI's code-only key
    tiles (its values stay joined). 8- and 4-bit codes, and 2-bit ones as half-words (`plane_words`: 8
    planes of a row's half-words), head_dim a power of two with planes at least 16 columns wide (a dot's K is at
    least 16: head_dim 128 for INT4 and INT2, 64 for INT8), on no more warps than a plane dot's output has
    8-column tiles (16 rows; more warps would each compute it whole): INT's value planes have a row's words as
    columns, KIVI's key planes the tile's tokens. The kernel also needs KIVI's value groups of whole words and a key
    tile inside one group (`KIVI_KPLANES`)."""
    per = plane_count(bits) if bits in (2, 4, 8) else 0  # planes (2 bits: of half-words)
    words = head_dim // per if per else 0  # a plane's columns
    if not per or head_dim != dim_pad(head_dim) or words < 16 or not cfg.get("PLANES", PLANES_DEFAULT):
        return False
    cols = {KV_FORMAT_INT: words, KV_FORMAT_KIVI: cfg.get("BLOCK_N", 0)}.get(kv_format, 0)
    return cols // 8 >= cfg.get("num_warps", 1) > 0

