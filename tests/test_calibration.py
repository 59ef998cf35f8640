"""The calibration rule (`studies/calibration.choose_setting`) and its printed verdict, on hand-made rows."""
from qerl_lib.studies.calibration import choose_setting, format_calibration


def row(base, level, temperature, pass1, mixed):
    return {"base": base, "level": level, "temperature": temperature, "pass@1": pass1, "mixed_groups": mixed,
            "truncated_rate": 0.0, "mean_length": 100.0}


def test_in_window_prefers_temperature_one_then_the_most_mixed_groups():
    rows = [row("bf16", 1, 0.7, 0.30, 0.9), row("bf16", 2, 1.0, 0.40, 0.5), row("bf16", 3, 1.0, 0.35, 0.6),
            row("bf16", 4, 1.0, 0.60, 1.0), row("nvfp4", 5, 1.0, 0.30, 1.0)]
    chosen = choose_setting(rows)
    assert (chosen["level"], chosen["temperature"], chosen["in_window"]) == (3, 1.0, True)
    assert "(the closest" not in format_calibration({"rows": rows, "chosen": chosen})


def test_outside_the_window_the_closest_setting_is_chosen_and_said_to_be_outside():
    rows = [row("bf16", 1, 1.0, 0.05, 0.9), row("bf16", 2, 1.0, 0.50, 0.2), row("bf16", 3, 0.7, 0.60, 0.8)]
    chosen = choose_setting(rows)
    assert (chosen["level"], chosen["in_window"]) == (2, False)
    text = format_calibration({"rows": rows, "chosen": chosen})
    assert text.splitlines()[-1].startswith("chosen: level 2, temperature 1.0 (the closest: none in the pass@1 window")


def test_without_bf16_rows_nothing_is_chosen_and_the_fix_is_named():
    rows = [row("nvfp4", 1, 1.0, 0.30, 0.9)]
    assert choose_setting(rows) is None
    assert format_calibration({"rows": rows, "chosen": None}).splitlines()[-1] == (
        "chosen: none (the rule chooses among bf16 settings: add bf16 to --bases)")
