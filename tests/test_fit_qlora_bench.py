"""The script that predicts where LoRA and QLoRA fit (``benchmarks/fit_qlora.py``) runs,
labels what it writes predictions, and holds QLoRA's base in less memory than LoRA's, so
that QLoRA fits a longer sequence each way on each device (``--quick``: four layers)."""

from __future__ import annotations

from conftest import quick_predictions


def test_qlora_holds_less_and_fits_longer_sequences_on_each_device(tmp_path, monkeypatch):
    script, data = quick_predictions("fit_qlora", monkeypatch, tmp_path / "f")
    rows = {(r["tuning"], r["device"]): r for r in data["rows"]}
    devices = {device for _, device in rows}
    assert len(rows) == 2 * len(devices) == 4
    for device in devices:
        lora, qlora = rows["LoRA", device], rows["QLoRA", device]
        assert qlora["weights_gib"] < lora["weights_gib"]
        assert qlora["checkpointing_peak_gib"] < lora["checkpointing_peak_gib"]
        for how in script.WAYS:
            assert qlora["longest"][how] > lora["longest"][how], (device, how)
        # the planner's mix fits the device, at least as fast as checkpointing every layer
        assert qlora["plan_fits"] and qlora["plan_vs_checkpointing"] >= 1
    assert "- kind: prediction" in (tmp_path / "f.md").read_text()
