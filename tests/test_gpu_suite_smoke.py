"""bench/gpu_suite.py --smoke: every section of the GPU suite runs on the CPU through Triton's interpreter.

The suite is the one script a borrowed GPU runs; a Python error in it would waste that lease. The smoke
run exercises the same code (same tables, shrunk by `smoke_shape`; correctness checks against fp64; one
timed call per case) in a fresh interpreter with TRITON_INTERPRET=1, and these tests read its JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import load_script

from codesign.autotune.ops import parse_shape, registered_ops

SUITE = Path(__file__).resolve().parents[1] / "bench" / "gpu_suite.py"
# ~70 s each on an idle 2-core machine; the bound catches a hang, not slowness (a loaded machine ran past 170 s).
SMOKE_TIMEOUT = 400
# Report key each bench module writes (its section); a new bench module must be added here.
BENCH_SECTIONS = {
    "gpu_attention": "paged_attention",
    "gpu_df11": "df11",
    "gpu_hf": "hf_generate",
    "gpu_kvquant": "kv_quant",
    "gpu_ops": "ops",
    "gpu_quant_gemm": "quant_gemm",
}


def _suite():
    return load_script(SUITE, "_gpu_suite_smoke")


def _env() -> dict[str, str]:
    # A fresh interpreter that sees no GPU: the smoke run must never touch one, even where one exists.
    return {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def _smoke(tmp_path: Path, *extra: str, timeout: float = SMOKE_TIMEOUT) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "smoke.json"
    p = subprocess.run([sys.executable, str(SUITE), "--smoke", "--out", str(out), *extra], capture_output=True,
                       text=True, env=_env(), timeout=timeout)  # fmt: skip
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return p, json.loads(out.read_text())


def _tunable() -> set[str]:
    return {n for n in registered_ops() if not n.startswith("test_")}


@pytest.mark.slow
def test_smoke_correctness_and_tuning_cover_every_op(tmp_path):
    """Ceilings, correctness and tuning sections in one smoke run (the kernel benchmarks: the test below)."""
    suite = _suite()
    p, rep = _smoke(tmp_path, "--skip", "kernel_benches", timeout=SMOKE_TIMEOUT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert rep["smoke"] and rep["env"]["gpu"] == "cpu-interpreter" and rep["finished"] and not rep["errors"]
    assert set(rep["section_seconds"]) == {"ceilings", "correctness", "tuning"}

    # Ceilings: the two numbers, from real (if tiny) runs.
    assert rep["ceilings"]["copy_GBps"] > 0 and rep["ceilings"]["bf16_matmul_TFLOPs"] > 0

    # Correctness: every tunable op has rows; every row ran and passed, except bf16 ones skipped for the
    # declared reason; each dtype of the real run is present; shapes are the tables' through smoke_shape.
    rows = rep["correctness"]["rows"]
    assert {r["op"] for r in rows} == _tunable()
    for r in rows:
        if r.get("skipped"):
            assert r["dtype"] == "bfloat16" and r["skipped"] == suite.BF16_REASON, r
        else:
            assert r["ok"] is True and r["rel_error_seed1"] <= r["bound"], r
            assert r["real_shape"] in suite.CORRECTNESS_SHAPES[r["op"]], r
            assert parse_shape(r["shape"]) == suite.smoke_shape(parse_shape(r["real_shape"])), r
    assert {r["dtype"] for r in rows} == set(suite.CORRECTNESS_DTYPES)
    assert rep["correctness"]["all_ok"] and rep["correctness"]["n"] == sum(not r.get("skipped") for r in rows)

    # Tuning: one row per registered op, each with a correct best config, the default's time, its table entry.
    t = rep["tuning"]
    assert t["error"] is None, t["error"]
    assert {r["op"] for r in t["rows"]} == _tunable()
    for r in t["rows"]:
        assert r.get("best") is not None and r["default_ms"] > 0 and r["n_failed"] == 0, r
        assert r["shape"] == suite.smoke_shape(parse_shape(suite.TUNE_SHAPES[r["op"]])), r
        # The export ships the best candidate, or no entry where the default (timed beside it) was faster.
        entry = t["tables"].get(r["table_op"], {}).get("entries", {}).get(r["key"], {}).get(str(r["m"]))
        assert entry == (None if r["default_ms"] < r["best_ms"] else r["best"]), (r, entry)


def _check_kv_quant(rep: dict) -> dict:
    """The quantized-KV section: every format timed, the shape sweep, every target, the designs timed beside the
    defaults. Returns the section."""
    kv = {r["format"] for r in rep["kv_quant"]["rows"]}
    assert kv >= {"int8", "int4", "int2", "fp8", "int4-kivi", "int2-kivi", "int4-oaken", "mixed-8/4/4/2"}
    assert sum("check_ok" in r for r in rep["kv_quant"]["rows"]) == 6
    base = rep["kv_quant"]["rows"][0]  # the unquantized cache, also timed with GPT-OSS's attention sinks
    assert base["sinks_ms"] > 0 and base["sinks_overhead_pct"] == 100 * (base["sinks_ms"] / base["ms"] - 1)
    # The shape sweep: every format at each swept point, a positive share of its byte floor; every target.
    kq = rep["kv_quant"]
    sweep_fmts = {"bf16", "int8", "int4", "int2", "fp8", "int4-kivi", "int2-kivi", "int4-oaken", "mixed-8/4/4/2"}
    points = {tuple(p) for p in kq["sweep_info"]["points"]}
    assert points and (16, 32768) in points
    for pt in points:
        at = [r for r in kq["sweep"] if (r["batch"], r["context"]) == pt]
        assert {r["format"] for r in at} == sweep_fmts, pt
        assert all(r["ms"] > 0 and r["floor_bytes"] > 0 and r["pct_of_floor"] > 0 for r in at), pt
    assert set(kq["sweep_targets"]) == {f"{f}_speedup_b16_c32k" for f in
                                        ("int8", "fp8", "int4", "int4-kivi", "int4-oaken", "mixed-8/4/4/2")} | {
        "all_formats_pct_of_floor_b16_c8k", "bf16_pct_of_copy_b16_c8k"}  # fmt: skip
    assert all({"measured", "target", "met"} <= set(t) for t in kq["sweep_targets"].values())
    # the design each default replaced, timed beside it (gpu_kvquant.JOINED: code planes, mixed by width)
    joined = {r["format"]: r for r in kq["rows"] if "joined_ms" in r}
    assert set(joined) == {"int4", "int2", "int8", "int4-kivi", "int2-kivi", "mixed-8/4/4/2"}
    assert all(r["joined_ms"] > 0 for r in joined.values())
    # the register-capped defaults, timed uncapped beside them (gpu_kvquant.uncapped())
    uncapped = {r["format"]: r for r in kq["rows"] if "uncapped_ms" in r}
    assert set(uncapped) == {"int4", "int4-kivi"} and all(r["uncapped_ms"] > 0 for r in uncapped.values())
    assert all(r["uncapped_config"]["MAXNREG"] == 0 for r in uncapped.values())
    # Oaken: each decode path forced beside the default (their outputs compared on a GPU only)
    oaken = next(r for r in kq["rows"] if r["format"] == "int4-oaken")
    assert oaken["one_launch_ms"] > 0 and oaken["split_ms"] > 0 and oaken["split_rel_diff"] is None
    assert oaken["stored_bits"] > oaken["bits"]  # the outlier index the kernels read, beside the format's bits
    return kq


@pytest.mark.slow
def test_smoke_kernel_benches_all_run_and_check(tmp_path):
    """Every bench/gpu_*.py module runs in smoke mode, writes its section and its correctness checks pass."""
    suite = _suite()
    p, rep = _smoke(tmp_path, "--skip", "ceilings", "correctness", "tuning", timeout=SMOKE_TIMEOUT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert rep["finished"] and not rep["errors"] and set(rep["section_seconds"]) == {"kernel_benches"}
    benches = rep["kernel_benches"]
    assert set(benches) == set(BENCH_SECTIONS) == {q.stem for q in suite._bench_modules()}
    for name, key in BENCH_SECTIONS.items():
        assert benches[name]["ok"], benches[name]
        sec = rep[key]
        assert "skipped" not in sec, (key, sec)
        assert sec.get("rows") or sec.get("shapes") or sec.get("calibration"), key
        assert sec["checks_ok"] is True, (key, sec)
    qg = rep["quant_gemm"]["rows"]
    assert {r["kernel"] for r in qg} >= {"fp16_matmul", "w4a16_g128", "w8a16_pc", "w8a8_int8", "fp8"}
    assert sum(r["rel_err"] is not None for r in qg) >= 8 and all(r["ms"] > 0 for r in qg)
    assert {r["M"] for r in qg} == {suite.smoke_shape({"M": m})["M"] for m in (1, 4, 16, 64, 256, 1024, 4096)}
    # The fused-quantizer W8A8 / FP8 variant pinned beside the two-launch path: timed and checked.
    for v in ("w8a8_int8@fusedq", "fp8@fusedq", "w8a8_int8@triton"):
        assert any(r["kernel"] == v and r["rel_err"] is not None and r["rel_err_ok"] for r in qg), v
    # Issue 20's targets, each with its worst measured speed-up (smoke's Ms are not the real ones: the structure only).
    tg = rep["quant_gemm"]["targets"]
    assert set(tg) == {"w4a16_m1", "w4a16_m16", "w4a16_m256_up", "w8a8_int8_m1024_up", "w8a8_int8_m16",
                       "fp8_m1024_up", "fp8_m16", "w4a16_vs_gemlite"}  # fmt: skip
    assert all({"measured", "target", "met", "at"} <= set(t) for t in tg.values()), tg
    assert tg["w4a16_m1"]["measured"] is not None, tg
    # The peer path with the stand-in peer: installed (already importable), timed, checked, compared.
    assert rep["quant_gemm"]["peers"]["dequant"]["ok"] and rep["quant_gemm"]["peers_checks_ok"] is True
    peer_rows = [r for r in qg if r.get("peer") == "dequant"]
    assert {r["kernel"] for r in peer_rows} == {"dequant:w4a16_g128", "dequant:w8a8_int8", "dequant:fp8"}
    assert sum(r["rel_err"] is not None for r in peer_rows) >= 3
    table = rep["quant_gemm"]["compare"]
    assert {r["format"] for r in table} == {"w4a16_g128", "w8a8_int8", "fp8"}
    assert all(r["best_peer"] == "dequant" and r["ours_vs_best_peer"] > 0 and r["ours_vs_bf16"] > 0 for r in table)
    att = rep["paged_attention"]["rows"]
    assert {r["kind"] for r in att if "ms" in r} == {"decode", "extend", "tree", "latent_decode"}
    assert sum("check_ok" in r for r in att) >= 10
    for r in att:  # skips: the real run's over-budget caches, and bf16 in smoke mode, nothing else
        if "skipped" in r:
            assert r["skipped"].startswith("cache ") or "bf16" in r["skipped"], r
    kq = _check_kv_quant(rep)
    # The printed summary gives every target a line (what a short GPU lease's log must show).
    lines = [x for x in suite.target_lines(rep) if x.startswith("target ")]
    trees = sum("vs_extend" in r for r in att)
    assert trees and len(lines) == len(tg) + len(kq["sweep_targets"]) + 3 + trees, lines
    _check_prefill_and_single_ops(rep)
    df = rep["df11"]
    assert df["all_bit_exact"] and df["small_m_4096x4096"] and df["shapes"] and df["sweep_4096x4096"]
    # The rows layout beside the flat one: decoded bit for bit, its GEMV timed at M = 1 in smoke mode.
    assert df["rows_layout"] and all(r["bit_exact"] and r["gemv"] for r in df["rows_layout"])
    assert df["layouts_side_by_side"]


def _check_prefill_and_single_ops(rep: dict) -> None:
    """gpu_hf's prefill rows and gpu_ops' single operators (the smoke run's report)."""
    # Prefill end to end (time to first token) beside the design model's prefill step: the bf16-weight variants.
    pre = rep["hf_generate"]["prefill_rows"]
    assert [r["variant"] for r in pre] == ["hf-sdpa", "codesign-int4"], pre
    assert all(r["prefill_s"] > 0 and r["predicted_prefill_s"] > 0 and r["prompt"] == 8 for r in pre), pre
    # DeepSeek (MLA): transformers' own beside the latent cache, bf16 and e4m3, each with the MLA graph's prediction.
    mla = rep["hf_generate_mla"]
    assert mla["checks_ok"] is True and "deepseek-v3" in mla["model"], mla
    assert [r["variant"] for r in mla["rows"]] == ["hf-sdpa", "codesign-latent", "codesign-latent-fp8"], mla
    assert all(r["predicted_decode_tokens_per_s"] > 0 for r in mla["rows"]), mla
    assert [r["variant"] for r in mla["prefill_rows"]] == [r["variant"] for r in mla["rows"]], mla
    assert all(r["prefill_s"] > 0 and r["predicted_prefill_s"] > 0 for r in mla["prefill_rows"]), mla
    # Single operators for the GPU model's fit (gpu_ops): every calibration op; decode and prefill of a layer,
    # attention by ours and by torch's sdpa beside the GEMMs, norms and elementwise ops.
    ops = rep["ops"]
    assert {r["op"] for r in ops["calibration"]} == {"matmul", "softmax", "layernorm", "gelu"}
    assert [lay["phase"] for lay in ops["layers"]] == ["decode", "prefill"]
    impls = {r["impl"] for lay in ops["layers"] for r in lay["rows"]}
    assert {"codesign paged decode", "torch sdpa (contiguous cache)", "torch sdpa (causal)", "torch.matmul",
            "torch rms_norm", "torch silu * up", "torch add", "codesign rms_norm", "codesign silu_mul",
            "torch rotate_half", "codesign rope"} <= impls  # fmt: skip
    # Hybrid models' recurrent steps: transformers' torch functions beside ours, each op timed both ways.
    st = ops["states"]
    assert [(r["op"].split()[0], r["impl"]) for r in st] == [
        (op, impl) for op in ("gated_delta_rule",) * 2 + ("gated_delta_tree", "ssd_tree", "gated_delta_rule",
                                                          "ssd_scan", "selective_state_update", "selective_scan",
                                                          "ssd_update")
        for impl in ("transformers torch", "codesign")
    ], st
    assert all(r["ms"] > 0 and r["bytes"] > 0 for r in st), st



def test_kernel_benches_run_most_needed_first():
    """A lease's deadline cuts the suite where it is: the issues' main benches run before the rest."""
    names = [p.stem for p in _suite()._bench_modules()]
    assert names == ["gpu_quant_gemm", "gpu_kvquant", "gpu_attention", "gpu_df11", "gpu_hf", "gpu_ops"], names

def test_target_lines_say_each_target_and_whether_it_was_met():
    suite = _suite()
    rep = {"quant_gemm": {"targets": {"w4a16_m1": dict(measured=1.8, target=2.0, met=False, at="square 8192 M=1"),
                                      "fp8_m16": dict(measured=None, target=1.0, met=None, at=None)}},
           "kv_quant": {"sweep_targets": {"int8_speedup_b16_c32k": dict(measured=1.7, target=1.6, met=True)}},
           "df11": {"decode_target_met": True, "gemv_target_met": False},
           "paged_attention": {"rows": [dict(kind="tree", nodes=64, vs_extend=1.4, target_vs_extend=1.3),
                                        dict(kind="decode", ms=0.1)]}}  # fmt: skip
    assert suite.target_lines(rep) == [
        "target w4a16_m1: 1.8 (>= 2.0) MISSED at square 8192 M=1",
        "target fp8_m16: not measured (>= 1.0) -",
        "target int8_speedup_b16_c32k: 1.7 (>= 1.6) met",
        "target df11 decode_target: met",
        "target df11 gemv_target: MISSED",
        "target tree vs extend (64 nodes): 1.40x (<= 1.3x) MISSED",
    ]
    assert suite.target_lines({}) == []


def test_smoke_refuses_to_write_into_bench_results():
    results = SUITE.parent / "results" / "smoke-test-must-not-exist.json"
    p = subprocess.run([sys.executable, str(SUITE), "--smoke", "--out", str(results)], capture_output=True,
                       text=True, env=_env(), timeout=60)  # fmt: skip
    assert p.returncode == 2 and "refusing" in p.stderr and not results.exists()


def test_sigterm_keeps_the_sections_done_so_far(tmp_path):
    """A `timeout` (SIGTERM) mid-run: exit 124, the JSON holds what finished, marked unfinished."""
    out = tmp_path / "smoke.json"
    proc = subprocess.Popen([sys.executable, str(SUITE), "--smoke", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # the first write comes after the ceilings section
        assert out.exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say what it was doing (its log), not only that it ran on
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"still running 60 s after SIGTERM:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 124, stdout[-2000:] + stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["finished"] is False and "terminated" in rep["errors"] and "ceilings" in rep


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise, expected
def test_a_sigterm_whose_raise_a_finalizer_drops_still_stops_the_suite_by_the_next_save():
    """Python prints and drops an exception raised in `__del__`: a SIGTERM handled there must still stop the
    sections at the next save, not let the suite run on (the subprocess test above timed out that way once)."""
    suite = _suite()
    ran, saves = [], []

    class SignalsInDel:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside the finalizer, and its raise is dropped
                pass

    def first():
        SignalsInDel()  # freed at once: its __del__ runs the handler
        ran.append("first")
        save()

    def save():
        saves.append(1)
        suite.raise_if_terminated()

    report = {"errors": {}}
    before = signal.getsignal(signal.SIGTERM)
    code = suite._run_sections(report, [("first", first), ("second", lambda: ran.append("second"))], set(), save)
    assert code == 124 and ran == ["first"] and "terminated" in report["errors"] and saves == [1]
    assert signal.getsignal(signal.SIGTERM) is before and not suite._SIGTERM_SEEN["active"]  # handler put back
    suite.raise_if_terminated()  # outside the sections a stale flag raises nothing


def test_smoke_shapes_are_accepted_by_every_op():
    """The one scaling function keeps every table shape valid for its kernel, and changes nothing on a GPU."""
    from codesign.autotune.ops import get_op

    suite = _suite()
    for name in _tunable():
        op = get_op(name)
        for text in [suite.TUNE_SHAPES[name], *suite.CORRECTNESS_SHAPES[name]]:
            real = parse_shape(text)
            small = suite.smoke_shape(real)
            op.check_shape(small)
            assert set(small) == set(real), (text, small)
            assert all(0 < small[k] <= real[k] or small[k] == real[k] == 0 for k in real), (text, small)
            assert suite.GPU.scale(**real) == real and suite.SMOKE.scale(**real) == small


@pytest.mark.parametrize(
    "real, small",
    [
        ({"M": 1, "K": 4096, "G": 128}, {"M": 1, "K": 128, "G": 128}),
        ({"M": 300, "N": 1000, "K": 1000}, {"M": 18, "N": 4, "K": 32}),
        ({"batch": 64, "ctx": 32768, "q_heads": 12, "kv_heads": 8},
         {"batch": 8, "ctx": 182, "q_heads": 2, "kv_heads": 1}),
        ({"head_dim": 80, "block_size": 16, "prefix": 0}, {"head_dim": 80, "block_size": 16, "prefix": 0}),
    ],
)  # fmt: skip
def test_smoke_shape_rules(real, small):
    assert _suite().smoke_shape(real) == small


def test_gpu_hf_runs_chosen_variants(tmp_path):
    """bench/gpu_hf.py --variants (bench/gpu_session.sh's step 5: compiled decode beside captured decode; compiled
    tree forwards) on the smoke model: a row per variant and batch, every token made."""
    import torch._dynamo

    hf = load_script(Path(__file__).resolve().parents[1] / "bench" / "gpu_hf.py", "_gpu_hf_smoke")
    out = tmp_path / "hf.json"
    names = ["codesign-bf16-fused-graph", "codesign-bf16-fused-compiled", "codesign-bf16-tree-compiled"]
    try:
        assert hf.main(["--smoke", "--variants", *names, "--batches", "2", "--new-tokens", "3",
                        "--out", str(out)]) == 0  # fmt: skip
    finally:
        torch._dynamo.reset()
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == names
    assert all(r["tokens"] == 3 and r["decode_tokens_per_s"] > 0 for r in rows), rows
