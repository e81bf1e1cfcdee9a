"""Glue for training frameworks that own the DDP wrapper, the optimizer and the checkpoint.

* :mod:`commpress.integrations.lightning`: ``CompressionCallback`` for a Lightning
  ``Trainer(strategy="ddp")`` (CPU and GPU), carrying every rank's state in its checkpoints.
* :mod:`commpress.integrations.accelerate`: ``register(accelerator, model, codec, ...)`` after
  ``accelerator.prepare``, with per-rank state files in ``accelerator.save_state`` directories.
* :mod:`commpress.integrations.ranks`: every rank's state in one checkpoint, without pickle.

Each framework module imports its framework; importing this package imports neither.
"""
