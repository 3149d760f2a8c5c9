"""The import path of the SGLang integration before engines had a folder, kept for one
release: the same module as `portable_kv.engines.sglang` (not a copy), so patches and
`install()` state are shared.  Import `portable_kv.engines.sglang` instead."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("portable_kv.engines.sglang")
