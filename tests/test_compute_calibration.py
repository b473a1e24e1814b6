"""Fitting the roofline's parameters from kernel timings: known parameters recovered from
synthetic timings made by the model itself (with noise), the fragment the config loader
accepts, errors that name what is wrong, and a real ``calibrate --measure`` on this CPU."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import yaml

from ilp_planner.cli import main
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.calibration import cluster_fragment
from ilp_planner.inputs.compute_calibration import (
    ComputeCalibration,
    KernelTiming,
    compute_section,
    fit_compute,
    read_kernel_csv,
    write_kernel_csv,
)
from ilp_planner.inputs.config import parse_config
from tests.helpers.procs import run

# an H100-like device: 800 TFLOP/s asymptote, d½ 96, 3 TB/s, 6 µs per kernel
TRUE = ComputeCalibration(8e14, 96.0, 3e12, 6e-6, 0, 0.0, 0.0)
# squares, and the shapes measure_kernels times on a GPU that keep one dimension small
# yet stay compute-bound (where a matmul is memory-bound its time says nothing of d½)
SHAPES = [(s, s, s) for s in (64, 128, 256, 512, 1024, 2048, 4096, 8192)] + [
    (16, 4096, 4096), (8192, 8192, 256), (8192, 256, 8192), (256, 8192, 8192),
    (8192, 8192, 512), (8192, 512, 8192)]
STREAMS = [2.0 * 4**p for p in range(5, 15)]


def synthetic(noise: float, seed: int = 0, truth: ComputeCalibration = TRUE) -> list[KernelTiming]:
    """Timings the model predicts for ``truth``, each times exp(N(0, noise))."""
    rng = np.random.default_rng(seed)
    rows = [KernelTiming("matmul", m, n, k, 2.0 * (m * k + k * n + m * n), 1.0)
            for m, n, k in SHAPES] + [KernelTiming("stream", 0, 0, 0, b, 1.0) for b in STREAMS]
    return [KernelTiming(r.kernel, r.m, r.n, r.k, r.bytes,
                         truth.predict(r) * float(np.exp(rng.normal(0.0, noise)))) for r in rows]


def test_exact_timings_are_recovered() -> None:
    c = fit_compute(synthetic(0.0))
    assert c.matmul_flops == pytest.approx(TRUE.matmul_flops, rel=1e-4)
    assert c.half_dim == pytest.approx(TRUE.half_dim, rel=1e-3)
    assert c.bandwidth == pytest.approx(TRUE.bandwidth, rel=1e-9)
    assert c.floor_s == pytest.approx(TRUE.floor_s, rel=1e-9)
    assert c.max_abs_rel < 1e-4


@pytest.mark.parametrize("seed", range(5))
def test_noisy_timings_recover_the_parameters(seed: int) -> None:
    """3 % multiplicative noise: every parameter within 15 %, d½ (seen through a few
    factors of 0.6–0.9 only) within 30 %."""
    c = fit_compute(synthetic(0.03, seed))
    assert c.matmul_flops == pytest.approx(TRUE.matmul_flops, rel=0.15)
    assert c.half_dim == pytest.approx(TRUE.half_dim, rel=0.3)
    assert c.bandwidth == pytest.approx(TRUE.bandwidth, rel=0.15)
    assert c.floor_s == pytest.approx(TRUE.floor_s, rel=0.15)


def test_no_size_effect_fits_a_small_half_dim() -> None:
    truth = ComputeCalibration(1e11, 0.0, 5e10, 2e-6, 0, 0.0, 0.0)
    c = fit_compute(synthetic(0.0, truth=truth))
    assert c.half_dim < 1.0 and c.matmul_flops == pytest.approx(1e11, rel=1e-3)


@pytest.mark.parametrize(("keep", "match"), [
    (lambda r: r.kernel == "matmul" or r.bytes == STREAMS[0], "two different sizes"),
    (lambda r: r.kernel == "stream" or r.m == 64, "at least two shapes"),
])
def test_underdetermined_fits_say_why(keep, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        fit_compute([r for r in synthetic(0.0) if keep(r)])


def test_row_validation() -> None:
    with pytest.raises(ValueError, match="kernel: expected one of"):
        KernelTiming("conv", 1, 1, 1, 8.0, 1e-3)
    with pytest.raises(ValueError, match="m, n, k"):
        KernelTiming("matmul", 0, 1, 1, 8.0, 1e-3)
    with pytest.raises(ValueError, match="seconds"):
        KernelTiming("stream", 0, 0, 0, 8.0, 0.0)


def test_section_is_relative_to_a_given_datasheet_and_refuses_beating_it() -> None:
    c = fit_compute(synthetic(0.0))
    s = compute_section(c, peak_tflops=989, hbm_gbps=3350)
    assert s["matmul_efficiency"] == pytest.approx(800 / 989, rel=1e-4)
    assert s["memory_efficiency"] == pytest.approx(3000 / 3350, rel=1e-9)
    assert s["kernel_floor_us"] == pytest.approx(6.0, rel=1e-9)
    plain = compute_section(c)
    assert plain["matmul_efficiency"] == plain["memory_efficiency"] == 1.0
    with pytest.raises(ConfigError, match="exceeds the datasheet"):
        compute_section(c, peak_tflops=500)


def test_fragment_gives_the_loader_a_device_with_the_fitted_parameters() -> None:
    c = fit_compute(synthetic(0.01))
    frag = yaml.safe_load(cluster_fragment({}, compute_section(c, 989, 3350)))
    assert set(frag["cluster"]) == {"compute"}
    doc = {"model": {"kind": "mlp", "dims": [8, 8], "batch": 4},
           "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gib": 80, "peak_tflops": 989,
                       "links": {"intra": {"alpha": 1e-5, "beta": 1e-10},
                                 "inter": {"alpha": 1e-5, "beta": 1e-9}},
                       **frag["cluster"]}}
    dev = parse_config(doc, "frag.yaml").cluster.device
    assert dev.fit.matmul_efficiency * dev.peak("bfloat16") == pytest.approx(c.matmul_flops)
    assert dev.fit.memory_efficiency * dev.hbm_bytes_per_s == pytest.approx(c.bandwidth)
    assert dev.fit.matmul_half_dim == pytest.approx(c.half_dim)


def test_csv_round_trip_and_bad_rows(tmp_path) -> None:
    rows = synthetic(0.02)
    path = tmp_path / "k.csv"
    write_kernel_csv(rows, path)
    assert read_kernel_csv(path) == rows
    path.write_text("kernel,m,n,k,bytes,seconds\nmatmul,2,2,2,48,fast\n")
    with pytest.raises(ConfigError, match="k.csv: line 2: could not convert"):
        read_kernel_csv(path)
    path.write_text("kernel,m,n,bytes,seconds\nstream,0,0,8,1\n")
    with pytest.raises(ConfigError, match="missing column 'k'"):
        read_kernel_csv(path)


def test_cli_fits_kernels_from_a_csv_alone(tmp_path, capsys) -> None:
    path = tmp_path / "kernels.csv"
    write_kernel_csv(synthetic(0.0), path)
    assert main(["calibrate", "--kernel-timings", str(path), "--peak-tflops", "989"]) == 0
    out = capsys.readouterr()
    assert "compute: matmul 800 TFLOP/s" in out.err
    section = yaml.safe_load(out.out)["cluster"]["compute"]
    assert section["matmul_efficiency"] == pytest.approx(800 / 989, rel=1e-4)


@pytest.mark.slow
def test_real_measure_on_this_cpu_writes_a_loadable_fragment(tmp_path) -> None:
    """``calibrate --measure --quick``: collectives under torchrun (2 gloo ranks), kernels
    here; the fragment's links and compute section load into a cluster config."""
    frag = tmp_path / "frag.yaml"
    res = run([sys.executable, "-m", "ilp_planner.cli", "calibrate", "--measure",
               "--nproc-per-node", "2", "--sizes", "262144,4194304,16777216", "--repeats", "3",
               "--quick", "-o", str(frag)], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "kernels.csv").is_file() and (tmp_path / "timings.csv").is_file()
    section = yaml.safe_load(frag.read_text())["cluster"]
    doc = {"model": {"kind": "mlp", "dims": [64, 64], "batch": 8},
           "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gib": 2, "peak_tflops": 0.1,
                       "links": {"inter": {"alpha": 1e-4, "beta": 1e-9}, **section["links"]},
                       "compute": section["compute"]}}
    cluster = parse_config(doc, str(frag)).cluster
    assert cluster.device is not None and cluster.device.fit.kernel_floor_s > 0
