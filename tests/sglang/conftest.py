"""SGLang 0.5.23's own HiCache code on portable_kv pools, on the CPU (`tox -e sglang`).

Each module skips itself where sglang is not importable (the plain test run).  The runtime
context is published as SGLang's own tests do (`published_topology` in
sglang/test/test_utils.py): a ServerArgs for a dummy model, rank zero.
"""

from __future__ import annotations

import pytest
from sglangkit import DEVICE_TOKENS, DTYPE, HEADS, LAYERS, PAGE, SKIP_REASON, device_pool  # noqa: F401

import portable_kv.engines.sglang as pk_sglang


@pytest.fixture
def topology(request):
    """Publish SGLang's runtime context for one rank, with the host-pool settings a test asks for."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def publish_args(**fields):
        reset_context()
        args = ServerArgs(model_path="dummy", page_size=PAGE, **fields)
        publish(args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
        return args

    yield publish_args
    reset_context()


@pytest.fixture
def installed():
    pk_sglang.install()
    yield
    pk_sglang.uninstall()
