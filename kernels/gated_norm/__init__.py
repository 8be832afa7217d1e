"""The gated per-head RMS norm op (gated_norm/fused.py) and its PyTorch definition (gated_norm/naive.py)."""
