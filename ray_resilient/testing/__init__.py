"""The rig: what ray_resilient's tests and benchmarks run on, for chaos runs of your own jobs too.

A multi-node Ray cluster on one machine whose nodes can really be lost (:class:`LocalRayCluster`),
driver processes that can be killed like real ones (:class:`Driver`), a real S3 server on
loopback (:func:`seaweedfs`), data to train on (:func:`make_image_volume`,
:class:`SyntheticBatches`), free ports and :func:`wait_until`. The names in ``__all__`` are
stable; the experiment kit the chaos benchmarks share, built on them, is not (:mod:`.kit`).
``python -m ray_resilient.testing`` is the command line that ``cluster/local.sh`` uses. Names are
imported on first use (:mod:`ray_resilient._lazy`).
"""

from typing import TYPE_CHECKING

from ray_resilient._lazy import lazy_exports
from ray_resilient.testing import kit

if TYPE_CHECKING:  # the real edges, for readers and tools; at run time each name is imported on first use
    from ray_resilient.testing.driver import Driver, DriverError, run_driver
    from ray_resilient.testing.image_volume import SHAPES, make_image_volume
    from ray_resilient.testing.local_cluster import LocalNode, LocalRayCluster
    from ray_resilient.testing.ports import LOOPBACK, free_port
    from ray_resilient.testing.s3_server import S3Server, seaweedfs
    from ray_resilient.testing.synthetic_data import CLASSES, FEATURES, SyntheticBatches
    from ray_resilient.testing.waiting import wait_until

_EXPORTS = {
    "Driver": "driver",
    "DriverError": "driver",
    "run_driver": "driver",
    "SHAPES": "image_volume",
    "make_image_volume": "image_volume",
    "LocalNode": "local_cluster",
    "LocalRayCluster": "local_cluster",
    "LOOPBACK": "ports",
    "free_port": "ports",
    "S3Server": "s3_server",
    "seaweedfs": "s3_server",
    "CLASSES": "synthetic_data",
    "FEATURES": "synthetic_data",
    "SyntheticBatches": "synthetic_data",
    "wait_until": "waiting",
}
__all__ = list(_EXPORTS)
# Until tests/test_survivors.py and tests/test_survivors_unit.py import them from .kit, the kit's names
# resolve here too, outside __all__ (so tests/test_layering.py still refuses them outside benchmarks/, tests/).
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS | dict.fromkeys(kit.__all__, "kit"))
