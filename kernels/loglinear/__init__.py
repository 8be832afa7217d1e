"""Log-linear attention (Guo et al.) on the generalized and HDLA recurrences: kernels/README.md §7."""
