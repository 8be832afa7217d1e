"""The rank-one delta rule with a write scale apart from beta (kernels/README.md §12): KDA's recurrence, and HDLA's
over two steps per token (steps.py)."""
