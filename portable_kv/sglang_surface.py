"""The host-pool surface SGLang 0.5.23's cache controller and storage backends use
(docs/API.md, "The SGLang 0.5.23 host-pool surface"): slot allocation, sizes,
physical transfer entry points.  A mixin of AsymmetricHostPool.
"""

from __future__ import annotations


class SGLangSurface:
    pass
