"""``make bench`` (ddp_lab.bench): interleaved pairs, ratios as median / min / max, bus
bandwidth, the JSON it writes; and one tiny real run of every measurement."""

from __future__ import annotations

import json

import pytest

from ddp_lab import bench


def test_launches_alternate_reference_and_trainer_round_by_round():
    assert bench.interleaved(2, [1, 2]) == [
        (0, 1, "reference"),
        (0, 1, "trainer"),
        (0, 2, "reference"),
        (0, 2, "trainer"),
        (1, 1, "trainer"),
        (1, 1, "reference"),
        (1, 2, "trainer"),
        (1, 2, "reference"),
    ]
    three = [kind for _, _, kind in bench.interleaved(3, [2], bench.KINDS)]
    assert [three[3 * i] for i in range(3)] == list(bench.KINDS)  # each kind leads a round


def test_ratios_are_pairwise_with_median_min_max():
    r = bench.ratio_stats([90.0, 200.0, 49.0, 100.0], [100.0, 200.0, 50.0, 80.0])
    assert r["ratios"] == pytest.approx([0.9, 1.0, 0.98, 1.25])
    assert (r["median"], r["min"], r["max"]) == pytest.approx((0.99, 0.9, 1.25))
    with pytest.raises(ValueError, match="pairs"):
        bench.ratio_stats([1.0], [1.0, 2.0])


def test_bus_bandwidth_follows_the_ring_convention():
    assert bench.bus_bandwidth(1e6, 1e-3, 2) == pytest.approx(1e9)  # 2(n-1)/n = 1
    assert bench.bus_bandwidth(1e6, 1e-3, 4) == pytest.approx(1.5e9)


def test_json_shape_and_launch_order(monkeypatch, tmp_path):
    """Stand-in launches (no process started): the calls come in interleaved pairs per
    process count, and bench.json / bench.png hold every part."""
    calls = []

    def fake_reference(args, nproc, data="trainer"):
        calls.append(("plain" if data == "memory" else "reference", nproc))
        return (110.0 if data == "memory" else 100.0) * nproc, 1000.0 * nproc

    def fake_trainer(args, nproc):
        calls.append(("trainer", nproc))
        return (99.0, None, 9.0) if nproc == 1 else (188.1, 0.1, 12.0)

    monkeypatch.setattr(bench, "run_reference", fake_reference)
    monkeypatch.setattr(bench, "run_trainer", fake_trainer)
    sizes = [4096, 1 << 24]
    monkeypatch.setattr(
        bench,
        "collectives",
        lambda args: {
            "comm_share": {"synced_median_s": 0.1, "no_sync_median_s": 0.08, "share": 0.2},
            "bandwidth": {
                "sizes": sizes,
                "world_size": 2,
                "bus_bandwidth": {"all_reduce": [1e7, 1e9], "ring": [9e6, 9e8]},
                "fit": {
                    "all_reduce": {"alpha_s": 1e-4, "bandwidth_bytes_per_s": 1e9},
                    "ring": {"alpha_s": 1e-4, "bandwidth_bytes_per_s": 9e8},
                },
                "ring_over_all_reduce_at_16MiB_plus": [0.9],
            },
        },
    )
    assert bench.main(["--pairs", "2", "--out", str(tmp_path)]) == 0
    assert calls == [(k, n) for _, n, k in bench.interleaved(2, [1, 2], bench.KINDS)]
    result = json.loads((tmp_path / "bench.json").read_text())
    tp = result["throughput"]
    assert tp["np1"]["trainer_over_reference"]["median"] == pytest.approx(0.99)
    assert tp["np2"]["trainer_over_reference"]["ratios"] == pytest.approx([0.9405] * 2)
    assert tp["np1"]["trainer_over_plain"]["median"] == pytest.approx(0.9)
    assert tp["np2"]["trainer_over_plain"]["ratios"] == pytest.approx([188.1 / 220] * 2)
    assert tp["trainer_speedup"]["median"] == pytest.approx(1.9)
    assert tp["trainer_speedup"]["processes"] == 2
    assert len(tp["np2"]["load"]) == 6 and tp["np2"]["trainer_comm_share"] == [0.1, 0.1]
    assert tp["np2"]["plain_page_faults"] == [2000.0] * 2
    assert tp["np1"]["trainer_page_faults"] == [9.0] * 2
    assert {"comm_share", "bandwidth", "load_start", "load_end", "threads"} <= set(result)
    assert (tmp_path / "bench.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(300)  # three torchrun launches: ~70 s alone, more behind a loaded suite
def test_tiny_real_run_of_every_part(tmp_path):
    """2 processes, the mlp, 4 steps, one pair; 2 message sizes; one block each."""
    args = ["--model", "mlp", "--steps", "4", "--pairs", "1", "--nprocs", "2"]
    args += ["--blocks", "1", "--rounds", "1", "--repeats", "1", "--sizes", "4096", "65536"]
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    pair = result["throughput"]["np2"]
    assert pair["reference"][0] > 0 and pair["plain"][0] > 0 and pair["trainer"][0] > 0
    assert 0 < pair["trainer_comm_share"][0] < 1
    assert all(pair[f"{kind}_page_faults"][0] >= 0 for kind in bench.KINDS)
    assert result["comm_share"]["synced_median_s"] > 0
    bw = result["bandwidth"]
    assert set(bw["bus_bandwidth"]) == {"all_reduce", "ring"} and bw["sizes"] == [4096, 65536]
    assert all(v > 0 for v in bw["bus_bandwidth"]["ring"])
