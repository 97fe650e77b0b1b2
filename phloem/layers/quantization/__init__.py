"""Quantized linear layers: the `LinearMethod` seam (base.py), FP8 e4m3 W8A8 (fp8.py, its
arithmetic in fp8_math.py) and the checkpoint formats that carry it (formats.py)."""
