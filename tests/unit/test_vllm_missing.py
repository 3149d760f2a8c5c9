"""What an engine team meets when it asks portable_kv.engines.vllm for a vLLM class where vLLM is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

import portable_kv.engines.vllm as pk_vllm

VLLM_CLASSES = ["PortableKVOffloadingSpec", "PortableKVOffloadingWorker", "PortableKVLayerwiseConnector"]

# vLLM's absence, wherever this runs: None in sys.modules makes `import vllm` raise ModuleNotFoundError(name="vllm").
ASK = """
import sys
sys.modules["vllm"] = None
import portable_kv.engines.vllm as pk_vllm
try:
    getattr(pk_vllm, sys.argv[1])
except ImportError as exc:
    print(type(exc).__name__, exc.name, sep="|")
    print(exc)
"""


@pytest.mark.parametrize("name", VLLM_CLASSES)
def test_a_vllm_class_without_vllm_says_which_release_and_how_to_install_it(name):
    out = subprocess.run([sys.executable, "-c", ASK, name], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kind, message = out.stdout.splitlines()
    assert kind == "ImportError|vllm"  # not ModuleNotFoundError: the missing piece is a release of vLLM, named below
    assert f"portable_kv.engines.vllm.{name}" in message
    assert 'pip install "portable_kv[vllm]"' in message and f"vllm=={pk_vllm.VLLM_VERSION}" in message


def test_the_package_and_its_vllm_free_parts_import_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import portable_kv.engines.vllm as m\n"
            "print(m.VLLM_VERSION, m.HostTier.__name__, m.choose_io.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [pk_vllm.VLLM_VERSION, "HostTier", "choose_io"]


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="PortableKVNoSuchThing"):
        pk_vllm.PortableKVNoSuchThing  # noqa: B018
