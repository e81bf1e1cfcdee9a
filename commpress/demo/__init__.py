"""Demos and the end-to-end benchmark's training engine (real data, no downloads).

- :mod:`.workloads`: the one set of models and data readers (byte-level LMs on the standard
  library's sources, MLPs on scikit-learn's digits) shared by the demos, the benchmarks and
  the parameter server demos (:mod:`commpress.ps.demos`).
- :mod:`.runner`: one DDP rank training a workload under a method (PyTorch hooks or commpress).
- :mod:`.train`: the ``commpress train`` demo: dense vs commpress on local workers.
"""
