"""Low-communication training: local SGD and DiLoCo with compressed outer gradients.

Each rank trains a plain module (no DDP wrapper) with its own optimizer; every H inner steps the
ranks synchronise inside that optimizer's ``step()``, so the training loop does not change:

- :class:`LocalSGD` (:mod:`.localsgd`): average the parameters every H steps;
- :class:`DiLoCo` (:mod:`.diloco`): an outer optimizer (Nesterov SGD) steps on the averaged
  pseudo-gradient ``theta_global - theta_local``, reduced through commpress's codecs and
  collectives with error feedback (:mod:`.outer`);
- streaming DiLoCo: ``DiLoCo(..., fragments=k, overlap=tau)`` syncs 1/k of the parameters every
  H/k steps, each sync an async collective merged tau steps later;
- replicas of several ranks: ``replica_group=`` (DDP inside a replica, DiLoCo across replicas);
- :mod:`.schedule`: the step hook, argument checks, fault scope, the bounded wait that names a
  rank lost between syncs, the cross-replica groups and configuration agreement they share.

Example::

    with commpress.local.DiLoCo(model, opt, sync_every=16) as diloco:
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

``DiLoCo(..., codec="auto")`` (:mod:`.auto`) chooses the outer codec from the cost model.

Not built yet (issue #26): the parameter server as an outer-step server.
"""

from .diloco import DEFAULT_CODEC, DEFAULT_SYNC_EVERY, DiLoCo
from .localsgd import LocalSGD
from .outer import OuterReduction
from .schedule import LocalSchedule

__all__ = ["DEFAULT_CODEC", "DEFAULT_SYNC_EVERY", "DiLoCo", "LocalSGD", "LocalSchedule", "OuterReduction"]
