"""α–β calibration (AutoDDL §3.2): recover known link parameters from synthetic noisy timings,
the CSV reader's errors, and the ``calibrate`` verb end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from ilp_planner.cli import main
from ilp_planner.commands import calibrate as calibrate_verb
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.calibration import (
    TimingRow,
    cluster_fragment,
    coefficients,
    fit_link,
    fit_links,
    fit_report,
    read_timings_csv,
    write_timings_csv,
)
from ilp_planner.inputs.compute_calibration import KernelTiming, read_kernel_csv, write_kernel_csv
from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.cluster import Link
from ilp_planner.lowering.cost_model import CollectiveKind, collective_time

K = CollectiveKind
TRUE = {
    "intra": Link(alpha=8e-6, beta=1 / 150e9),  # 8 µs, 150 GB/s (NVLink-like)
    "inter": Link(alpha=3e-5, beta=8 / 100e9),  # 30 µs, 100 Gb/s (InfiniBand-like)
}
GROUPS = {"intra": (2, 4, 8), "inter": (2, 4, 16)}
SIZES = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8)


def synthetic_rows(noise: float = 0.02, seed: int = 0) -> list[TimingRow]:
    """Every collective × group size × message size on both links, with multiplicative
    Gaussian noise of relative standard deviation ``noise``."""
    rng = np.random.default_rng(seed)
    rows = []
    for link, truth in TRUE.items():
        for kind in K:
            for p in GROUPS[link]:
                for n in SIZES:
                    t = collective_time(kind, p, n, truth) * (1 + noise * rng.standard_normal())
                    rows.append(TimingRow(kind, p, n, link, t))
    return rows


@pytest.mark.parametrize(
    ("kind", "p"),
    [(kind, p) for kind in K for p in (1, 2, 3, 8) if p > 1 or kind in (K.BROADCAST, K.P2P)],
)
def test_coefficients_match_cost_model(kind: CollectiveKind, p: int) -> None:
    link = Link(alpha=3.3e-6, beta=7e-11)
    a, b = coefficients(kind, p, 12345.0)
    assert a * link.alpha + b * link.beta == pytest.approx(
        collective_time(kind, p, 12345.0, link), rel=1e-12)


def test_exact_timings_are_recovered_exactly() -> None:
    fits = fit_links(synthetic_rows(noise=0.0))
    assert list(fits) == ["intra", "inter"]
    for link, truth in TRUE.items():
        f = fits[link]
        assert f.alpha == pytest.approx(truth.alpha, rel=1e-9)
        assert f.beta == pytest.approx(truth.beta, rel=1e-9)
        assert f.r2 == pytest.approx(1.0) and f.max_abs_rel < 1e-9
        assert f.n_rows == len(K) * len(GROUPS[link]) * len(SIZES)
        assert not f.alpha_clamped


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_timings_recover_alpha_and_beta(seed: int) -> None:
    fits = fit_links(synthetic_rows(noise=0.02, seed=seed))
    for link, truth in TRUE.items():
        f = fits[link]
        assert f.alpha == pytest.approx(truth.alpha, rel=0.03)
        assert f.beta == pytest.approx(truth.beta, rel=0.03)
        assert f.r2 > 0.99
        # 2 % noise: residuals of that order, none wild
        assert 0.005 < f.median_abs_rel < 0.04 and f.max_abs_rel < 0.1
        assert len(f.rel_residuals) == f.n_rows
        assert f.to_link() == Link(f.alpha, f.beta)


def test_relative_weighting_pins_latency_better_than_absolute() -> None:
    rows = synthetic_rows(noise=0.02, seed=0)
    rel = fit_link(rows, "inter", weighting="relative")
    absolute = fit_link(rows, "inter", weighting="absolute")
    truth = TRUE["inter"].alpha
    assert abs(rel.alpha - truth) < abs(absolute.alpha - truth)
    assert absolute.weighting == "absolute"


def _negative_intercept_rows() -> list[TimingRow]:
    # seconds = n·1e-9 − 1e-7: the unconstrained fit has α = −1e-7
    return [TimingRow(K.P2P, 2, n, "intra", n * 1e-9 - 1e-7) for n in (1e3, 1e4, 1e5, 1e6)]


def test_negative_alpha_is_refitted_at_zero() -> None:
    rows = _negative_intercept_rows()
    free = fit_link(rows, "intra", nonnegative=False)
    assert free.alpha == pytest.approx(-1e-7, rel=1e-6) and not free.alpha_clamped
    f = fit_link(rows, "intra")
    assert f.alpha == 0.0 and f.alpha_clamped
    assert f.beta == pytest.approx(1e-9, rel=0.05)  # β alone absorbs the intercept
    assert "refitted with α = 0" in fit_report({"intra": f})


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([TimingRow(K.ALL_GATHER, 4, 1e6, "intra", 1e-3)] * 5, "do not determine both"),
        ([TimingRow(K.ALL_GATHER, p, 0, "intra", 1e-5) for p in (2, 4, 8)],
         "do not determine both"),
        ([TimingRow(K.P2P, 2, n, "intra", 1e-3 - n * 1e-12) for n in (1e3, 1e6, 1e8)],
         "do not grow with message size"),
        ([], "no timings"),
    ],
)
def test_unidentifiable_fits(rows: list[TimingRow], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        fit_links(rows)


def test_timing_row_validation() -> None:
    with pytest.raises(ValueError, match="group_size"):
        TimingRow(K.ALL_REDUCE, 1, 1e6, "intra", 1e-3)
    with pytest.raises(ValueError, match="link"):
        TimingRow(K.ALL_REDUCE, 2, 1e6, "nvlink", 1e-3)
    with pytest.raises(ValueError, match="seconds"):
        TimingRow(K.ALL_REDUCE, 2, 1e6, "intra", 0.0)
    TimingRow(K.BROADCAST, 1, 1e6, "inter", 1e-3)  # one receiver is a valid broadcast


def test_report_and_fragment() -> None:
    fits = fit_links(synthetic_rows(noise=0.0))
    report = fit_report(fits)
    assert "alpha (us)" in report and "Gb/s" in report
    intra_line = next(line for line in report.splitlines() if line.startswith("intra"))
    assert "8.000" in intra_line  # α in µs
    assert "1200" in intra_line  # 150 GB/s = 1200 Gb/s
    doc = yaml.safe_load(cluster_fragment(fits))
    assert set(doc) == {"cluster"} and set(doc["cluster"]) == {"links"}
    for link, truth in TRUE.items():
        assert doc["cluster"]["links"][link] == {
            "alpha": pytest.approx(truth.alpha), "beta": pytest.approx(truth.beta)}


def test_report_names_a_missing_level() -> None:
    rows = [r for r in synthetic_rows(noise=0.0) if r.link == "intra"]
    fits = fit_links(rows)
    assert list(fits) == ["intra"]
    assert "inter: no timings" in fit_report(fits)


def test_fragment_is_accepted_by_the_config_loader() -> None:
    fits = fit_links(synthetic_rows(noise=0.01))
    links = yaml.safe_load(cluster_fragment(fits))["cluster"]["links"]
    doc = {
        "model": {"kind": "mlp", "dims": [8, 8], "batch": 4},
        "cluster": {"nodes": 2, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 100,
                    "links": links},
    }
    cluster = parse_config(doc, "calibrated.yaml").cluster
    assert cluster.intra == fits["intra"].to_link()
    assert cluster.inter == fits["inter"].to_link()


# ---- CSV and CLI ------------------------------------------------------------------------------
def test_csv_round_trip(tmp_path) -> None:
    rows = synthetic_rows()
    path = tmp_path / "t.csv"
    write_timings_csv(rows, path)
    assert read_timings_csv(path) == rows


def test_csv_columns_in_any_order_extra_ignored(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("seconds,link,rank,bytes,group_size,collective\n"
                    "\n"
                    "1e-3, INTRA ,0,1e6,4,All_Gather\n")
    assert read_timings_csv(path) == [TimingRow(K.ALL_GATHER, 4, 1e6, "intra", 1e-3)]


HEADER = "collective,group_size,bytes,link,seconds\n"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (HEADER + "all_gather,4,1e6,intra,1e-3\nallreduce,4,1e6,intra,1e-3\n",
         r"t\.csv:3: collective: unknown collective 'allreduce'"),
        (HEADER + "all_reduce,4,1MB,intra,1e-3\n", r"t\.csv:2: bytes: expected a number, got '1MB'"),
        (HEADER + "all_reduce,4.5,1e6,intra,1e-3\n", r"t\.csv:2: group_size: expected an integer"),
        (HEADER + "all_reduce,1,1e6,intra,1e-3\n", r"t\.csv:2: group_size: all_reduce needs"),
        (HEADER + "all_reduce,4,1e6,nvlink,1e-3\n", r"t\.csv:2: link: expected one of"),
        (HEADER + "all_reduce,4,1e6,intra,-1\n", r"t\.csv:2: seconds: expected a finite number > 0"),
        (HEADER + "all_reduce,4,-5,intra,1e-3\n", r"t\.csv:2: bytes: expected a finite"),
        (HEADER + "all_reduce,4,nan,intra,1e-3\n", r"t\.csv:2: bytes: expected a finite"),
        (HEADER + "all_reduce,4,1e6,intra\n", r"t\.csv:2: expected 5 fields like the header, got 4"),
        ("collective,group_size,bytes,seconds\nall_reduce,4,1e6,1e-3\n",
         r"t\.csv:1: header lacks column\(s\) link"),
        ("", r"t\.csv: empty file"),
        (HEADER, r"t\.csv: no timing rows"),
    ],
)
def test_malformed_csv(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_timings_csv(path)


def test_missing_csv(tmp_path) -> None:
    with pytest.raises(ConfigError, match="nope.csv: cannot read timings"):
        read_timings_csv(tmp_path / "nope.csv")


def test_cli_writes_fragment(tmp_path, capsys) -> None:
    csv_path, out = tmp_path / "timings.csv", tmp_path / "fragment.yaml"
    write_timings_csv(synthetic_rows(), csv_path)
    assert main(["calibrate", str(csv_path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "alpha (us)" in printed and "intra" in printed and "inter" in printed
    doc = yaml.safe_load(out.read_text())
    for link, truth in TRUE.items():
        got = doc["cluster"]["links"][link]
        assert set(got) == {"alpha", "beta"}
        assert got["alpha"] == pytest.approx(truth.alpha, rel=0.03)
        assert got["beta"] == pytest.approx(truth.beta, rel=0.03)


def test_cli_fragment_on_stdout(tmp_path, capsys) -> None:
    csv_path = tmp_path / "timings.csv"
    write_timings_csv(synthetic_rows(noise=0.0), csv_path)
    assert main(["calibrate", str(csv_path)]) == 0
    captured = capsys.readouterr()
    assert "alpha (us)" in captured.err  # the report goes to stderr, the YAML stays clean
    doc = yaml.safe_load(captured.out)
    assert doc["cluster"]["links"]["intra"]["alpha"] == pytest.approx(8e-6)


def test_cli_reports_malformed_csv(tmp_path, capsys) -> None:
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text(HEADER + "all_reduce,4,lots,intra,1e-3\n")
    assert main(["calibrate", str(csv_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.csv:2: bytes: expected a number, got 'lots'" in err


def test_cli_creates_the_fragment_folders_and_refuses_a_folder_before_measuring(
        tmp_path, capsys, monkeypatch) -> None:
    """``-o missing/dir/frag.yaml`` is created as every verb's output is; a folder given for
    the fragment is refused before torchrun is started."""
    csv_path = tmp_path / "timings.csv"
    write_timings_csv(synthetic_rows(noise=0.0), csv_path)
    out = tmp_path / "missing" / "dir" / "frag.yaml"
    assert main(["calibrate", str(csv_path), "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["cluster"]["links"]
    capsys.readouterr()
    monkeypatch.setattr(calibrate_verb.subprocess, "call",
                        lambda *a, **k: pytest.fail("measured before checking the output"))
    assert main(["calibrate", "--measure", "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def _fake_measure(argv, stdout=None):
    """``runtime.measure`` as torchrun would run it: timings written where ``--output`` says,
    and the claim it prints; ``runtime.measure_dispatch`` (its own process) a host-time row."""
    target = argv[argv.index("--output") + 1]
    if "runtime.measure_dispatch" in argv:  # the recomputed plan's step: 20 kernels more
        again = "replay-plan" in argv[argv.index("--output") - 1]
        write_kernel_csv([KernelTiming("dispatch", 120 if again else 100, 0, 0, 0.0,
                                       4.6e-3 if again else 3e-3)], target)
        return 0
    write_timings_csv(synthetic_rows(noise=0.0), target)
    print(f"wrote timings to {target}", file=stdout)
    return 0


@pytest.mark.parametrize("with_output", [True, False])
def test_cli_measure_keeps_the_timings_it_says_it_wrote(tmp_path, capsys, monkeypatch,
                                                        with_output) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate_verb.subprocess, "call", _fake_measure)
    argv = ["calibrate", "--measure"] + (["-o", "fits/frag.yaml"] if with_output else [])
    assert main(argv) == 0
    out = capsys.readouterr()
    claimed = out.err.split("wrote timings to ")[1].split()[0]
    assert Path(claimed).is_file()
    assert Path(claimed).parent == (Path("fits") if with_output else Path("."))
    # the kernels measured here and the host's time (its own process: 3 ms for 100 kernels)
    fragment = Path("fits/frag.yaml").read_text() if with_output else out.out
    # and a replayed kernel's: (4.6 ms - 120 x 30 us) / 20 replayed = 50 us beyond dispatch
    compute = yaml.safe_load(fragment)["cluster"]["compute"]
    assert compute["dispatch_us"] == pytest.approx(30)
    assert compute["replay_us"] == pytest.approx(50)
    kept = read_kernel_csv(Path(claimed).parent / "kernels.csv")
    assert kept[-2:] == [KernelTiming("dispatch", 100, 0, 0, 0.0, 3e-3),
                         KernelTiming("replay", 120, 20, 0, 0.0, 4.6e-3)]
    for name in ("dispatch-plan.json", "replay-plan.json"):
        assert (Path(claimed).parent / name).is_file()
