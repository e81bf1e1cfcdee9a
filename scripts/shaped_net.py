"""The shaped-network harness under its old name: ``commpress.demo.shaped_net`` itself.

The harness moved into the package (``commpress train`` uses it from an installed copy); this
shim keeps ``from shaped_net import ShapedNetwork`` (scripts/bench_e2e.py, bench_fsdp_lm.py,
bench_link_fit.py) and ``python scripts/shaped_net.py ...`` working. Importing it binds this
name to the package module, so attributes set on one (a test's monkeypatch) are seen by both.
"""

import sys

from commpress.demo import shaped_net as _impl

if __name__ == "__main__":
    sys.exit(_impl.main())
sys.modules[__name__] = _impl
