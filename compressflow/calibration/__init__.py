"""Calibration: llm-compressor's oneshot (or the model-free pass) on the staged model, in a child.

- `run`: loading for calibration, the reference logits, oneshot or `model_free_ptq`, the
  per-module metrics (`tasks/calibrate.py` runs it in a child process);
- `resume`, `pipeline`: calibration checkpoints and the resumable copy of the library's
  sequential pipeline that writes them;
- `ranks`: each rank's share of the samples in a multi-GPU calibration;
- `args`, `result`: how calibration runs, and what it returns.
"""
