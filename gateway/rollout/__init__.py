"""Rollouts for training loops (docs/capture.md): rollout identity (``ids``), one call
record per model call committed before the answer is released (``records``,
``recorder``), token sources (``tokens``), the store (``store``), and the pure chain of
calls that says where token sequences extend each other (``chain``)."""
