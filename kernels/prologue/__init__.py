"""The mixer prologue op (prologue/fused.py) and its PyTorch definition (prologue/naive.py)."""
