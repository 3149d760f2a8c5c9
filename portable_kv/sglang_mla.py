"""The import path of SGLang's MLA host pool before engines had a folder: the same module
as `portable_kv.engines.sglang.mla` (not a copy)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("portable_kv.engines.sglang.mla")
