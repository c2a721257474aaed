"""Decode-time kernels the lab writes where no library reaches the weights' bandwidth (w4a16_gemv)."""
