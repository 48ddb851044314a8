"""One-off calibrations of a model's attention heads, for the head-level budget allocators.

`calibrated(model, kind, compute)` returns a small table measured once per model and kept in
memory and on disk (`store`); `heads` holds the measurements (RazorAttention's echo and
induction scores, HeadKV's retrieval scores, CoKV's Sliced Shapley values), all on synthetic
random-token prompts, so no data set or tokenizer is needed.
"""

from kvstack.calibrate.store import calibrated, calibration_dir, forget, measured_on, model_key

__all__ = ["calibrated", "calibration_dir", "forget", "measured_on", "model_key"]
