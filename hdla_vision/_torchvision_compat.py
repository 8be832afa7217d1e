"""Make torchvision's pure-Python parts importable when its C++ extension cannot load.

PyPI's Linux torchvision wheels link against the CUDA build of torch. With the CPU build
of torch (``requirements/cpu.txt``) the extension fails to load; torchvision then skips
every operator registration except two unguarded ``register_fake`` calls for
``torchvision::nms`` and ``torchvision::qnms``, and its import dies with
"operator torchvision::nms does not exist". That also breaks ``import timm``.

When (and only when) that exact failure happens, we declare the two operator schemas
(with no kernels) and import again. Transforms, datasets and models work; calling
``torchvision.ops.nms`` still raises torchvision's own "Couldn't load custom C++ ops".
"""
import sys

import torch

_MISSING_OPERATOR_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_schema_library = None


def _forget_partial_torchvision_import() -> None:
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]


def import_torchvision():
    """Import torchvision, working around a C++ extension built for another torch."""
    global _schema_library
    try:
        import torchvision
        return torchvision
    except RuntimeError as err:
        if "torchvision::nms" not in str(err) or _schema_library is not None:
            raise
    _forget_partial_torchvision_import()
    _schema_library = torch.library.Library("torchvision", "DEF")
    for schema in _MISSING_OPERATOR_SCHEMAS:
        _schema_library.define(schema)
    import torchvision
    return torchvision
