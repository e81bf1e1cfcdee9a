"""Demos and the end-to-end benchmark's training engine (real data, no downloads).

- :mod:`.workloads`: models and data (byte-level LM on the standard library's sources,
  scikit-learn digits, a communication-heavy wide MLP).
- :mod:`.runner`: one DDP rank training a workload under a method (PyTorch hooks or commpress).
- :mod:`.train`: the ``commpress train`` demo: dense vs commpress on local workers.
"""
