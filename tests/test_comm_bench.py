"""``shardwise bench comm`` end to end (tiny sizes), size parsing, and the ``comm.*`` config fields."""

from __future__ import annotations

import json

import pytest

from shardwise.config import Config, ConfigError
from shardwise.config_resolve import resolve
from shardwise.dist.comm.bench import main, parse_sizes


def test_parse_sizes():
    assert parse_sizes("4K..64M") == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert parse_sizes("4K,1M,16M,64M") == [4 << 10, 1 << 20, 16 << 20, 64 << 20]
    assert parse_sizes("1000") == [1000]


def test_bench_reports_bandwidth_prediction_and_ratio(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["--sizes", "4K,64K", "--nproc", "2", "--reps", "1", "--algorithms", "ring", "tree", "auto",
                 "--json", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "| 64K | ring |" in table and "auto -> " in table
    result = json.loads(out.read_text())
    assert set(result["auto_picks"]) == {str(4 << 10), str(64 << 10)}
    for row in result["rows"]:
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)  # nccl-tests all-reduce
        assert row["time_us"] > 0 and row["predicted_us"] > 0 and row["ratio_to_native"] > 0
    assert png.stat().st_size > 0


def test_bench_rejects_unknown_algorithm(capsys):
    assert main(["--algorithms", "hypercube"]) == 2
    assert "hypercube" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, fragment", [
    ({"comm.algorithm": "hypercube"}, "comm.algorithm='hypercube' is not valid; use one of 'auto', 'native'"),
    ({"comm.compression": "zip"}, "comm.compression='zip' is not valid; use one of 'none', 'fp16'"),
    ({"comm.topk_ratio": "0"}, "comm.topk_ratio=0.0 is not valid"),
])
def test_comm_config_is_validated(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        resolve(Config.load(overrides=overrides), tokenizer_vocab=257)
    assert fragment in str(e.value)


def test_comm_config_accepts_every_algorithm_and_compression():
    for key, value in [("comm.algorithm", "auto"), ("comm.algorithm", "torus"), ("comm.compression", "topk"),
                       ("comm.compression", "int8")]:
        resolve(Config.load(overrides={key: value}), tokenizer_vocab=257)
