"""The causal depthwise convolution over time (short_conv/fused.py) and its PyTorch definition (short_conv/naive.py)."""
