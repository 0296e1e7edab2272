"""The rig of ray_resilient's tests and benchmarks, for chaos runs of your own jobs too.

A multi-node Ray cluster on one machine whose nodes can really be lost (:class:`LocalRayCluster`),
driver processes that can be killed like real ones (:class:`Driver`), a real S3 server on
loopback (:func:`seaweedfs`), and data to train on (:func:`make_image_volume`,
:class:`SyntheticBatches`). ``python -m ray_resilient.testing`` is the command line that
``cluster/local.sh`` uses. Names are imported on first use (:mod:`ray_resilient._lazy`).
"""

from ray_resilient._lazy import lazy_exports

_EXPORTS = {
    "Driver": "driver",
    "DriverError": "driver",
    "run_driver": "driver",
    "make_image_volume": "image_volume",
    "LocalNode": "local_cluster",
    "LocalRayCluster": "local_cluster",
    "free_port": "ports",
    "S3Server": "s3_server",
    "seaweedfs": "s3_server",
    "SyntheticBatches": "synthetic_data",
    "wait_until": "waiting",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
