"""Kernels: the typed ops every codec calls, and the backends that run them.

- :mod:`.ops`: one typed wrapper per op, argument validation, backend choice per op and
  device (``native`` extension, ``numba`` / ``cupy``, ``reference``);
- :mod:`.schema`: every op's arguments, stated once (one typed record per op);
- :mod:`.backends`: the Python backends' registry;
- :mod:`.checks`: the kernel contract, one argument check per op, run before any backend;
- :mod:`.reference`: the pure-torch backend, each op run on its specification (:mod:`commpress.spec`);
- :mod:`.numba_cpu`, :mod:`.cupy_cuda`: the Python backends (imported on first use);
- :mod:`.blockint`: the int8/int4 codecs' fast path (the native ops, else vectorised torch).

Nothing here knows about codecs' wire layouts, collectives or DDP.
"""
