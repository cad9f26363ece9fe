"""`mmkv selftest`: it passes on the bundled model and the tiny Qwen3-VL MoE within its two minutes,
and it fails, naming the check, exit code 1, when the splice is broken (the re-rotation turned into
the identity) or a check raises."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mmkv.cli import app
from mmkv.selftest import TOLERANCES, run_selftest

CHECKS = ["splice", "rotation", "batched", "image", "skill"]


def _cli(*args: str):
    return CliRunner().invoke(app, ["selftest", *args])


def _identity_rotation(delta, rope):
    """A rotation that turns nothing: cached keys stay at the positions they were computed at."""
    n = 2 * rope.inv_freq.numel()
    return torch.ones(n), torch.zeros(n)


@pytest.fixture
def broken_rotation(monkeypatch):
    for module in ("mmkv.kv.rerotate", "mmkv.request.splice"):  # the splice holds its own name for it
        monkeypatch.setattr(f"{module}.rotation", _identity_rotation)


def test_passes_on_the_bundled_model_within_two_minutes():
    result = _cli("--device", "cpu", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert sum("  PASS  " in line for line in lines) == len(CHECKS) and "FAIL" not in result.stdout
    assert lines[-1].startswith("PASS: 5 of 5 checks passed in ")
    seconds = float(lines[-1].split(" in ")[1].split()[0])
    print(result.stdout)
    assert seconds < 120


def test_json_report_on_the_tiny_moe(tiny_dirs):
    result = _cli(str(tiny_dirs["qwen3_vl_moe"]), "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["family"] == "qwen3_vl_moe" and report["dtype"] == "float32"
    assert [c["name"] for c in report["checks"]] == CHECKS
    for check in report["checks"]:
        assert check["passed"] and 0 <= check["error"] <= check["tolerance"], check
    assert report["checks"][0]["tolerance"] == TOLERANCES[torch.float32]
    assert report["total_s"] < 120


def test_a_splice_without_rotation_fails_and_names_its_checks(broken_rotation):
    result = _cli("--device", "cpu")
    assert result.exit_code == 1, result.output
    failed = result.stdout.splitlines()[-1]
    assert failed.startswith("FAIL (splice, rotation, image, skill): 1 of 5 checks passed")
    for dtype, margin in (("float32", 100), ("bfloat16", 2)):  # caught well clear of either tolerance
        report = run_selftest(device="cpu", dtype=dtype)
        checks = {c.name: c for c in report.checks}
        assert not report.passed and checks["batched"].passed  # decoding does not rotate: it still agrees
        assert all(checks[n].error > margin * checks[n].tolerance for n in ("splice", "rotation", "image", "skill"))


def test_a_check_that_raises_fails_alone(monkeypatch):
    def broken_step(self, tokens, positions):
        raise RuntimeError("decode kernel missing")

    monkeypatch.setattr("mmkv.request.scheduler.DecodeBatch.step", broken_step)
    report = run_selftest(device="cpu", dtype="float32")
    assert [c.name for c in report.checks if not c.passed] == ["batched"]
    batched = report.checks[CHECKS.index("batched")]
    assert batched.error is None and batched.detail == "raised RuntimeError: decode kernel missing"
    result = _cli("--device", "cpu", "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["passed"] is False


def test_a_model_that_does_not_load_exits_2(tmp_path):
    result = _cli(str(tmp_path / "missing"))
    assert result.exit_code == 2 and "does not exist" in result.stderr and not result.stdout
