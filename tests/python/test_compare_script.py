"""bench/compare.py on a tiny problem: its ceilings (the FMA limit, the vdpbf16ps limit where measured and SGEMM from
`sattn bench --json`, torch.mm),
each row's share of the FMA limit, and its --json file, written atomically (an existing file is replaced whole)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
import sattn  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "compare.py")
CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sattn.__file__)))), "sattn")


@pytest.mark.skipif(not os.path.exists(CLI), reason=f"CLI {CLI} not built")
def test_tiny_run_reports_ceilings_and_shares_of_the_fma_limit(tmp_path):
    out = tmp_path / "rows.json"
    out.write_text("an earlier file")
    proc = subprocess.run([sys.executable, SCRIPT, "--dtypes", "fp32", "--passes", "fwd", "--masks", "full",
                           "--dims", "16", "--lens", "64", "--threads", "1", "--rounds", "1", "--decode-lens", "",
                           "--ceiling-n", "64", "--ceiling-reps", "1", "--sattn", CLI, "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "FMA limit " in proc.stdout and "%fma" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # no temporary file left behind
    ceiling = next(r for r in rows if r["kind"] == "ceiling")
    row = next(r for r in rows if r.get("pass") == "fwd")
    assert ceiling["torch_mm_fp32_n"] == ceiling["torch_mm_bf16_n"] == 64  # --ceiling-n 64: small enough to time
    fma = ceiling["fma_limit_gflops"]
    if sattn.simd_targets()["selected"] == "portable":
        assert fma is None and row["sattn_pct_fma_limit"] is None
    else:
        assert fma > 0
        assert row["sattn_pct_fma_limit"] == pytest.approx(100 * row["sattn_gflops"] / fma)
    # the vdpbf16ps limit: measured under the builds with bf16 dot products, printed with the FMA limit
    dot = ceiling["vdpbf16ps_limit_gflops"]
    if sattn.simd_targets()["selected"] in ("amx", "avx512bf16"):
        assert dot > 0 and f"vdpbf16ps limit {dot:.1f} GFLOP/s" in proc.stdout, proc.stdout
    else:
        assert dot is None and "vdpbf16ps" not in proc.stdout, proc.stdout


@pytest.mark.skipif(not os.path.exists(CLI), reason=f"CLI {CLI} not built")
@pytest.mark.parametrize("mask", ["bias", "padding"])
def test_mask_rows_compare_outputs_and_every_gradient(tmp_path, mask):
    """--masks bias: an additive [1, H, Lq, Lk] mask shared by the batch, whose gradient the backward computes too;
    --masks padding: a bool [B, 1, 1, Lk] padding mask. The outputs and gradients of the two sides agree."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--dtypes", "fp32", "--passes", "fwd,bwd", "--masks", mask,
                           "--dims", "16", "--lens", "24", "--batch", "3", "--heads", "2", "--threads", "1",
                           "--rounds", "1", "--decode-lens", "", "--ceiling-n", "64", "--ceiling-reps", "1",
                           "--sattn", CLI, "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "differ" not in proc.stdout, proc.stdout
    rows = [r for r in json.loads(out.read_text()) if r["kind"] == "sdpa"]
    assert sorted(r["pass"] for r in rows) == ["bwd", "fwd"] and all(r["mask"] == mask for r in rows)
    assert all(r["max_rel_diff"] < 1e-5 for r in rows), rows


@pytest.mark.skipif(not os.path.exists(CLI), reason=f"CLI {CLI} not built")
def test_blhd_layout_times_the_call_with_the_merge_of_the_heads(tmp_path):
    """--layout blhd: q, k, v viewed from [B, L, H, D] memory, each call followed by the merge of the heads into
    [B, Lq, H·D]; outputs and gradients (through the merge, GQA too) agree, and the layout is in the --json header."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--dtypes", "fp32", "--passes", "fwd,bwd", "--masks", "full,causal",
                           "--dims", "16", "--lens", "24", "--batch", "2", "--heads", "4", "--kv-heads", "2",
                           "--layout", "blhd", "--threads", "1", "--rounds", "1", "--decode-lens", "",
                           "--ceiling-n", "64", "--ceiling-reps", "1", "--sattn", CLI, "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "differ" not in proc.stdout and "out merged to [B, L, H*D]" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())
    assert rows[0]["layout"] == "blhd"
    sdpa = [r for r in rows if r["kind"] == "sdpa"]
    assert len(sdpa) == 4 and all(r["max_rel_diff"] < 1e-5 for r in sdpa), sdpa


@pytest.mark.skipif(not os.path.exists(CLI), reason=f"CLI {CLI} not built")
def test_float32_precision_is_set_for_both_sides(tmp_path):
    """--float32-precision high: torch.set_float32_matmul_precision("high") for the run, which sattn.torch follows
    (float32 as two bf16 in the amx forward); named in the header and the --json env row, the outputs within 1e-4."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--dtypes", "fp32", "--passes", "fwd", "--masks", "full,causal",
                           "--dims", "64", "--lens", "256", "--heads", "2", "--threads", "1", "--rounds", "1",
                           "--decode-lens", "", "--float32-precision", "high", "--ceiling-n", "64",
                           "--ceiling-reps", "1", "--sattn", CLI, "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "float32 matmul precision high" in proc.stdout and "differ" not in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())
    assert rows[0]["float32_precision"] == "high"
    sdpa = [r for r in rows if r["kind"] == "sdpa"]
    assert len(sdpa) == 2 and all(r["max_rel_diff"] < 1e-4 for r in sdpa), sdpa


def test_mha_script_times_both_modules_in_every_mode():
    script = os.path.join(REPO, "bench", "compare_mha.py")
    proc = subprocess.run([sys.executable, script, "--batch", "2", "--lens", "5", "--embed", "16", "--heads", "2",
                           "--rounds", "2", "--reps", "1", "--batch-first", "--cross"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["inference"], ["train"])]
    assert [r[0] for r in rows] == ["inference", "train"], proc.stdout
    for r in rows:
        sattn_ms, torch_ms, ratios = float(r[4]), float(r[5]), [float(x) for x in r[6:]]
        assert sattn_ms > 0 and torch_ms > 0 and len(ratios) == 3 and all(x > 0 for x in ratios), proc.stdout
    bad = subprocess.run([sys.executable, script, "--modes", "eval"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    assert bad.returncode == 2 and "--modes: expected inference or train, got 'eval'" in bad.stdout
